// The arena directory (snapshot/arena_dir.h): names, holder locks, and the gc / adoption /
// removal decisions. The plans are pure and tested with fake entries; the locks and scans run on
// a real temporary directory, with a forked child as the "other live process".
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "common/net.h"
#include "efdl/snapshot.h"
#include "snapshot/arena.h"
#include "snapshot/arena_dir.h"
#include "../support/temp_dir_test.h"

namespace efdl::snapshot {
namespace {

TEST(ArenaNames, RoundTripAndHolderHasNoDash) {
  EXPECT_EQ(HolderName("gpu-node-7.example", 2), "gpu_node_7.example.2");
  EXPECT_EQ(HolderName("", 0), "host.0");
  const std::string name = ArenaFileName("my-job/1", HolderName("gpu-node", 0), "rank12");
  EXPECT_EQ(name, "efdl-my-job_1-gpu_node.0-rank12.arena");
  auto parsed = ParseArenaFileName(name);
  ASSERT_TRUE(parsed);
  EXPECT_EQ(parsed->job, "my-job_1");
  EXPECT_EQ(parsed->holder, "gpu_node.0");
  EXPECT_EQ(parsed->scope, "rank12");
  EXPECT_EQ(ArenaPath("/d", "j", "h.0", "node"), "/d/efdl-j-h.0-node.arena");
  EXPECT_EQ(HolderLockPath("/d", "j", "h.0"), "/d/efdl-j-h.0.lock");
  EXPECT_EQ(SafeName(std::string(100, 'a')).size(), 80u);
  // Not arenas: temporaries of a growing arena, locks, other files, bad scopes.
  for (const char* other : {"efdl-j-h.0-node.arena.new-123", "efdl-j-h.0.lock", "x.arena",
                            "efdl-j-h.0-rank.arena", "efdl-j-h.0-rankx.arena", "efdl-node.arena",
                            "efdl--node.arena"}) {
    EXPECT_FALSE(ParseArenaFileName(other)) << other;
  }
  EXPECT_EQ(ShmDir(nullptr), "/dev/shm");
  EXPECT_EQ(ShmDir(""), "/dev/shm");
  EXPECT_EQ(ShmDir("/x"), "/x");
}

ArenaEntry Entry(std::string job, std::string holder, std::string scope, bool held,
                 std::optional<uint64_t> seq) {
  ArenaEntry e;
  e.name = {job, holder, scope};
  e.path = "/d/" + ArenaFileName(job, holder, scope);
  e.held = held;
  e.newest_seq = seq;
  return e;
}

TEST(ArenaPlans, GcRemovesOnlyDeadArenasAndSparesTheStartingJob) {
  std::vector<ArenaEntry> entries = {
      Entry("a", "h.0", "node", /*held=*/true, 5),    // live: kept
      Entry("a", "h.1", "node", /*held=*/false, 9),   // dead, job a
      Entry("b", "h.0", "node", /*held=*/false, 3),   // dead, job b
      Entry("b", "h.0", "rank1", /*held=*/false, std::nullopt),
  };
  EXPECT_EQ(PlanGc(entries, ""), (std::vector<std::string>{entries[1].path, entries[2].path,
                                                           entries[3].path}));
  // `efdl run --job a` adopts a's dead arena instead of removing it.
  EXPECT_EQ(PlanGc(entries, "a"),
            (std::vector<std::string>{entries[2].path, entries[3].path}));
}

TEST(ArenaPlans, AdoptionTakesTheNewestDeadArenaPerScope) {
  std::vector<ArenaEntry> entries = {
      Entry("j", "h.1", "node", false, 7),
      Entry("j", "h.2", "node", false, 9),    // newest dead: adopted
      Entry("j", "h.3", "node", true, 20),    // live: another node of the job on this host
      Entry("j", "h.4", "rank0", false, std::nullopt),  // no snapshot: removed
      Entry("k", "h.5", "node", false, 30),   // another job: not ours to touch
  };
  auto plan = PlanAdoption(entries, "j", "h.0", "/d");
  ASSERT_EQ(plan.moves.size(), 1u);
  EXPECT_EQ(plan.moves[0].from, entries[1].path);
  EXPECT_EQ(plan.moves[0].to, "/d/efdl-j-h.0-node.arena");
  EXPECT_EQ(plan.moves[0].seq, 9u);
  EXPECT_EQ(std::set<std::string>(plan.removes.begin(), plan.removes.end()),
            (std::set<std::string>{entries[0].path, entries[3].path}));
  // The adopter's own arena is newer: nothing is moved, the dead ones go.
  entries.push_back(Entry("j", "h.0", "node", true, 12));
  plan = PlanAdoption(entries, "j", "h.0", "/d");
  EXPECT_TRUE(plan.moves.empty());
  EXPECT_EQ(plan.removes.size(), 3u);
}

TEST(ArenaPlans, JobRemovalTakesOwnAndDeadButNotLiveOthers) {
  std::vector<ArenaEntry> entries = {
      Entry("j", "h.0", "node", true, 1),    // own (held by the caller)
      Entry("j", "h.1", "node", false, 1),   // an earlier agent's
      Entry("j", "h.2", "node", true, 1),    // another live node of the job
      Entry("k", "h.0", "node", false, 1),   // another job
  };
  EXPECT_EQ(PlanJobRemoval(entries, "j", "h.0"),
            (std::vector<std::string>{entries[0].path, entries[1].path}));
}

TEST(ArenaRoom, NotEnoughRoomIsOneLineWithSizeFreeAndVariable) {
  EXPECT_TRUE(CheckArenaRoom("/d", 100, 100).ok());
  Status s = CheckArenaRoom("/d", uint64_t{300} << 20, uint64_t{64} << 20);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("needs 300.0 MiB"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("64.0 MiB free"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("EFDL_SHM_DIR=/d"), std::string::npos) << s.message();
  EXPECT_EQ(s.message().find('\n'), std::string::npos);
}

class ArenaDirTest : public TempDirTest {
 protected:
  ArenaDirTest() : TempDirTest("arena-dir-test") {}
  void TearDown() override {
    for (pid_t pid : children_) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
  // As holder "h" of job "j": takes the dead holder's node arena over (exactly one adopted) and
  // opens it; `*lock`, this holder's lock, is the caller's to hold.
  void AdoptTheDeadHoldersArena(std::unique_ptr<HolderLock>* lock,
                                std::unique_ptr<SnapshotArena>* arena) {
    auto mine = HolderLock::Acquire(d(), "j", "h", "test");
    ASSERT_TRUE(mine.ok());
    *lock = std::move(mine).value();
    auto entries = ScanArenaDir(d(), HolderLockHeld);
    ASSERT_EQ(ApplyAdoption(d(), PlanAdoption(entries, "j", (*lock)->holder(), d()),
                            (*lock)->holder()), 1);
    auto opened = SnapshotArena::Open(ArenaPath(d(), "j", (*lock)->holder(), "node"));
    ASSERT_TRUE(opened.ok());
    *arena = std::move(opened).value();
  }
  // A child process that holds `path` locked (exclusive) until killed.
  void HoldInChild(const std::string& path) {
    int ready[2];
    ASSERT_EQ(::pipe(ready), 0);
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      // Not the parent's locks: a forked child shares their open file descriptions.
      for (int fd = 3; fd < 1024; ++fd) {
        if (fd != ready[1]) ::close(fd);
      }
      int fd = ::open(path.c_str(), O_RDWR | O_CREAT, 0600);
      ::flock(fd, LOCK_EX);
      (void)::write(ready[1], "x", 1);
      while (true) ::pause();
    }
    children_.push_back(pid);
    char c;
    ASSERT_EQ(::read(ready[0], &c, 1), 1);
    ::close(ready[0]);
    ::close(ready[1]);
  }
  // A real arena with one committed snapshot of `floats` floats (seq from the engine).
  // commit_checksum: EFDL_COMMIT_CHECKSUM=1 (every slot carries its checksum); the default
  // stores none until a persister hashes the slot.
  void MakeArena(const std::string& path, float value, int commits = 1,
                 bool commit_checksum = true) {
    EngineOptions o;
    o.job_id = "j";
    o.arena_path = path;
    o.commit_checksum = commit_checksum;
    auto engine = SnapshotEngine::Open(o);
    ASSERT_TRUE(engine.ok()) << engine.status().message();
    std::vector<float> data(1024, value);
    ASSERT_TRUE((*engine)->SetLayout({{"t", "float32", {1024}, 0, 4096}}).ok());
    for (int i = 0; i < commits; ++i) {
      ASSERT_TRUE((*engine)->Commit({{data.data()}}, i, "{}").ok());
    }
  }
  std::string d() const { return dir_.path(); }

  std::vector<pid_t> children_;
};

TEST_F(ArenaDirTest, LiveHoldersGetDistinctIndexesAndARestartGetsTheFreedOne) {
  auto first = HolderLock::Acquire(d(), "j", "h", "test");
  ASSERT_TRUE(first.ok()) << first.status().message();
  EXPECT_EQ((*first)->holder(), "h.0");
  HoldInChild(HolderLockPath(d(), "j", "h.1"));  // another live process holds index 1
  auto second = HolderLock::Acquire(d(), "j", "h", "test");
  ASSERT_TRUE(second.ok());
  EXPECT_EQ((*second)->holder(), "h.2");
  EXPECT_TRUE(HolderLockHeld(HolderLockPath(d(), "j", "h.0")));  // held by this process' fd
  EXPECT_TRUE(HolderLockHeld(HolderLockPath(d(), "j", "h.1")));
  first->reset();  // the holder of index 0 "dies"
  EXPECT_FALSE(HolderLockHeld(HolderLockPath(d(), "j", "h.0")));
  auto restarted = HolderLock::Acquire(d(), "j", "h", "test");
  ASSERT_TRUE(restarted.ok());
  EXPECT_EQ((*restarted)->holder(), "h.0");
  std::ifstream owner(HolderLockPath(d(), "j", "h.0"));
  std::string line;
  std::getline(owner, line);
  EXPECT_EQ(line, "pid " + std::to_string(::getpid()) + " test");
  // A shared lock cannot be had while an exclusive holder lives.
  auto shared = HolderLock::TryLockPath(HolderLockPath(d(), "j", "h.1"), /*shared=*/true);
  ASSERT_TRUE(shared.ok());
  EXPECT_EQ(*shared, nullptr);
}

TEST_F(ArenaDirTest, ScanGcAndAdoptionOnRealArenas) {
  const std::string live = ArenaPath(d(), "j", "h.1", "node");
  const std::string dead_old = ArenaPath(d(), "j", "h.2", "node");
  const std::string dead_new = ArenaPath(d(), "j", "h.3", "node");
  const std::string other_dead = ArenaPath(d(), "k", "h.0", "node");
  MakeArena(live, 1.0f, 5);
  MakeArena(dead_old, 2.0f, 1);
  MakeArena(dead_new, 3.0f, 3);
  MakeArena(other_dead, 4.0f, 1);
  HoldInChild(HolderLockPath(d(), "j", "h.1"));
  auto mine = HolderLock::Acquire(d(), "j", "h", "test");
  ASSERT_TRUE(mine.ok());
  ASSERT_EQ((*mine)->holder(), "h.0");

  auto entries = ScanArenaDir(d(), HolderLockHeld);
  ASSERT_EQ(entries.size(), 4u);
  for (const auto& e : entries) {
    EXPECT_EQ(e.held, e.path == live) << e.path;
    EXPECT_EQ(e.job, "j");  // from the manifest (MakeArena's engine is job "j")
    EXPECT_GT(e.bytes, 0u);
    ASSERT_TRUE(e.newest_seq);
  }
  auto removed = RemoveArenas(d(), PlanGc(entries, "j"), "h.0");
  EXPECT_EQ(removed, std::vector<std::string>{other_dead});
  EXPECT_TRUE(std::filesystem::exists(live));

  entries = ScanArenaDir(d(), HolderLockHeld);
  EXPECT_EQ(ApplyAdoption(d(), PlanAdoption(entries, "j", "h.0", d()), "h.0"), 1);
  const std::string own = ArenaPath(d(), "j", "h.0", "node");
  EXPECT_TRUE(std::filesystem::exists(own));
  EXPECT_FALSE(std::filesystem::exists(dead_new));
  EXPECT_FALSE(std::filesystem::exists(dead_old));  // older dead one of the job: removed
  EXPECT_TRUE(std::filesystem::exists(live));       // a live holder's: never touched
  // The dead holders' lock files went with their arenas; live and own ones stay.
  EXPECT_FALSE(std::filesystem::exists(HolderLockPath(d(), "j", "h.3")));
  EXPECT_TRUE(std::filesystem::exists(HolderLockPath(d(), "j", "h.1")));
  // The adopted arena restores the dead holder's newest snapshot, checksum verified.
  EngineOptions o;
  o.job_id = "j";
  o.arena_path = own;
  auto engine = SnapshotEngine::Open(o);
  ASSERT_TRUE(engine.ok());
  auto c = (*engine)->Candidates();
  ASSERT_FALSE(c.empty());
  EXPECT_EQ(c.front().manifest.seq, 3u);
  std::vector<float> out(1024);
  ASSERT_TRUE((*engine)->Restore(c.front(), {out.data()}).ok());
  EXPECT_EQ(out[7], 3.0f);

  // The job completes: own and dead arenas go, the live other holder's stays.
  entries = ScanArenaDir(d(), HolderLockHeld);
  removed = RemoveArenas(d(), PlanJobRemoval(entries, "j", "h.0"), "h.0");
  EXPECT_EQ(removed, std::vector<std::string>{own});
  EXPECT_TRUE(std::filesystem::exists(live));
}

TEST_F(ArenaDirTest, AdoptionDropsASlotThatFailsItsChecksum) {
  const std::string dead = ArenaPath(d(), "j", "h.1", "node");
  MakeArena(dead, 5.0f, 2);  // seqs 1 and 2, both with commit checksums
  {
    auto arena = SnapshotArena::Open(dead);
    ASSERT_TRUE(arena.ok());
    auto slots = (*arena)->ReadySlots();
    ASSERT_EQ(slots.size(), 2u);
    ASSERT_TRUE((*arena)->Checksum(slots[0].slot, slots[0].seq));  // committed with one
    (*arena)->data_area(slots[0].slot)[100] ^= 0x40;  // the dying writer scribbled on seq 2
  }
  std::unique_ptr<HolderLock> mine;
  std::unique_ptr<SnapshotArena> arena;
  ASSERT_NO_FATAL_FAILURE(AdoptTheDeadHoldersArena(&mine, &arena));
  auto slots = arena->ReadySlots();
  ASSERT_EQ(slots.size(), 1u);  // seq 2 dropped, seq 1 (intact) left to restore
  EXPECT_EQ(slots[0].seq, 1u);
}

TEST_F(ArenaDirTest, WithoutCommitChecksumsAnAdoptedSlotIsKeptUnverified) {
  // The default (EFDL_COMMIT_CHECKSUM=0): slots no persister hashed have no checksum, so the
  // adoption can check their manifests only - the accepted trade-off (docs/snapshots.md).
  const std::string dead = ArenaPath(d(), "j", "h.1", "node");
  MakeArena(dead, 5.0f, 2, /*commit_checksum=*/false);
  {
    auto arena = SnapshotArena::Open(dead);
    ASSERT_TRUE(arena.ok());
    auto slots = (*arena)->ReadySlots();
    ASSERT_EQ(slots.size(), 2u);
    EXPECT_FALSE((*arena)->Checksum(slots[0].slot, slots[0].seq));
  }
  std::unique_ptr<HolderLock> mine;
  std::unique_ptr<SnapshotArena> arena;
  ASSERT_NO_FATAL_FAILURE(AdoptTheDeadHoldersArena(&mine, &arena));
  EXPECT_EQ(arena->ReadySlots().size(), 2u);
}

TEST_F(ArenaDirTest, OrphanLocksGoHeldOrUsedOnesStay) {
  const std::string orphan = HolderLockPath(d(), "j", "h.5");
  std::ofstream(orphan) << "pid 1 gone\n";
  const std::string used = HolderLockPath(d(), "j", "h.6");
  std::ofstream(used) << "pid 1 gone\n";
  MakeArena(ArenaPath(d(), "j", "h.6", "node"), 1.0f);
  HoldInChild(HolderLockPath(d(), "j", "h.7"));
  EXPECT_EQ(RemoveOrphanLocks(d()), 1);
  EXPECT_FALSE(std::filesystem::exists(orphan));
  EXPECT_TRUE(std::filesystem::exists(used));
  EXPECT_TRUE(std::filesystem::exists(HolderLockPath(d(), "j", "h.7")));
}

TEST_F(ArenaDirTest, APlantedLinkOrForeignFileIsRefusedAndNeverWrittenThrough) {
  // Another user's file of the expected name: a link to a file of this user, and a file that
  // others may write. Opening must not follow, map or write either.
  const std::string victim = d() + "/victim";
  { std::ofstream(victim) << "precious"; }
  const std::string arena = ArenaPath(d(), "j", "h.0", "node");
  std::filesystem::create_symlink(victim, arena);
  auto opened = SnapshotArena::Open(arena);
  ASSERT_FALSE(opened.ok());
  EXPECT_TRUE(opened.status().IsFailedPrecondition()) << opened.status().message();
  EXPECT_NE(opened.status().message().find("symbolic link"), std::string::npos);
  EXPECT_NE(opened.status().message().find(arena), std::string::npos);
  // An engine ignores it with a warning and its first commit replaces the link, not the file.
  MakeArena(arena, 1.0f);
  EXPECT_FALSE(std::filesystem::is_symlink(arena));
  EXPECT_TRUE(SnapshotArena::Open(arena).ok());
  std::ifstream in(victim);
  std::string text;
  std::getline(in, text);
  EXPECT_EQ(text, "precious");

  const std::string lock = HolderLockPath(d(), "j", "h.0");
  std::filesystem::create_symlink(victim, lock);
  auto held = HolderLock::Acquire(d(), "j", "h", "test");
  ASSERT_FALSE(held.ok());
  EXPECT_NE(held.status().message().find("symbolic link"), std::string::npos);
  EXPECT_FALSE(HolderLockHeld(lock));
  std::ifstream again(victim);
  std::getline(again, text);
  EXPECT_EQ(text, "precious");

  const std::string open_to_all = ArenaPath(d(), "j", "h.1", "node");
  MakeArena(open_to_all, 2.0f);
  ASSERT_EQ(::chmod(open_to_all.c_str(), 0666), 0);
  auto loose = SnapshotArena::Open(open_to_all);
  ASSERT_FALSE(loose.ok());
  EXPECT_NE(loose.status().message().find("mode 0666"), std::string::npos)
      << loose.status().message();
}

TEST_F(ArenaDirTest, AnArenaOfAnotherUserIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a file to another user";
  const std::string arena = ArenaPath(d(), "j", "h.0", "node");
  MakeArena(arena, 1.0f);
  ASSERT_EQ(::chown(arena.c_str(), 65534, 65534), 0);
  auto opened = SnapshotArena::Open(arena);
  ASSERT_FALSE(opened.ok());
  EXPECT_NE(opened.status().message().find("belongs to uid 65534"), std::string::npos)
      << opened.status().message();
}

}  // namespace
}  // namespace efdl::snapshot
