#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>

#include "common/net.h"
#include "snapshot/arena.h"
#include "../support/temp_dir_test.h"

namespace efdl::snapshot {
namespace {

class ArenaTest : public TempDirTest {
 protected:
  ArenaTest() : TempDirTest("efdl-arena-test") {}
  void SetUpInDir() override {
    path_ = dir_.path() + "/test.arena";
  }
  std::unique_ptr<SnapshotArena> NewArena(int slots = 2) {
    auto a = SnapshotArena::Create(path_, slots, 4096, 1 << 16);
    EXPECT_TRUE(a.ok()) << a.status().ToString();
    EXPECT_TRUE((*a)->Install().ok());
    return std::move(a).value();
  }
  // Writes one snapshot whose data is `fill` repeated, manifest "m<seq>".
  static int Write(SnapshotArena& a, uint64_t seq, uint8_t fill) {
    auto slot = a.BeginWrite();
    EXPECT_TRUE(slot.ok()) << slot.status().ToString();
    std::memset(a.data_area(*slot), fill, 1024);
    std::string m = "m" + std::to_string(seq);
    std::memcpy(a.manifest_area(*slot), m.data(), m.size());
    a.Publish(*slot, seq, static_cast<int64_t>(seq) * 10, m.size(), 1024);
    return *slot;
  }
  std::string path_;
};

TEST_F(ArenaTest, PublishedSnapshotIsFoundByAnotherMappingOfThePath) {
  auto a = NewArena();
  EXPECT_TRUE(a->ReadySlots().empty());
  Write(*a, 1, 0x11);
  auto b = SnapshotArena::Open(path_);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  auto ready = (*b)->ReadySlots();
  ASSERT_EQ(ready.size(), 1u);
  EXPECT_EQ(ready[0].seq, 1u);
  EXPECT_EQ(ready[0].step, 10);
  EXPECT_EQ((*b)->data_area(ready[0].slot)[1023], 0x11);
}

TEST_F(ArenaTest, WriterNeverPicksTheNewestCompleteSnapshot) {
  auto a = NewArena();
  int last = Write(*a, 1, 1);
  for (uint64_t seq = 2; seq < 10; ++seq) {
    auto slot = a->BeginWrite();
    ASSERT_TRUE(slot.ok());
    EXPECT_NE(*slot, last);
    // While this slot is being written, the previous snapshot is still the newest ready one.
    auto ready = a->ReadySlots();
    ASSERT_FALSE(ready.empty());
    EXPECT_EQ(ready[0].seq, seq - 1);
    for (const auto& r : ready) EXPECT_NE(r.slot, *slot) << "a slot being written is visible";
    a->Publish(*slot, seq, 0, 1, 1024);
    last = *slot;
  }
}

TEST_F(ArenaTest, PinnedSlotIsLeftAloneAndFallsBackToOverwritingTheNewest) {
  auto a = NewArena();
  int first = Write(*a, 1, 1);
  ASSERT_TRUE(a->Pin(first, 1));
  int second = Write(*a, 2, 2);
  EXPECT_NE(second, first);
  // Only two slots: the older one is pinned (being persisted), so the writer reuses the newest.
  int third = Write(*a, 3, 3);
  EXPECT_EQ(third, second);
  EXPECT_EQ(a->data_area(first)[0], 1) << "pinned slot was overwritten";
  a->Unpin(first);
  EXPECT_EQ(Write(*a, 4, 4), first);
  EXPECT_FALSE(a->Pin(first, 1)) << "pinning a slot whose seq changed must fail";
}

TEST_F(ArenaTest, PinOfADeadProcessIsIgnored) {
  auto a = NewArena();
  int first = Write(*a, 1, 1);
  Write(*a, 2, 2);
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto mine = SnapshotArena::Open(path_);
    ::_exit(mine.ok() && (*mine)->Pin(first, 1) ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_EQ(Write(*a, 3, 3), first) << "a dead process's pin blocked the slot";
}

TEST_F(ArenaTest, WriterKilledMidCopyLeavesThePreviousSnapshotIntact) {
  auto a = NewArena();
  Write(*a, 1, 0x42);
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto mine = SnapshotArena::Open(path_);
    if (!mine.ok()) ::_exit(1);
    auto slot = (*mine)->BeginWrite();
    if (!slot.ok()) ::_exit(1);
    std::memset((*mine)->data_area(*slot), 0xEE, 512);  // half a copy, then death
    ::kill(::getpid(), SIGKILL);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status));
  auto b = SnapshotArena::Open(path_);
  ASSERT_TRUE(b.ok());
  auto ready = (*b)->ReadySlots();
  ASSERT_EQ(ready.size(), 1u);
  EXPECT_EQ(ready[0].seq, 1u);
  EXPECT_EQ((*b)->data_area(ready[0].slot)[0], 0x42);
  // The next writer reuses the abandoned slot.
  auto slot = (*b)->BeginWrite();
  ASSERT_TRUE(slot.ok());
  EXPECT_NE(*slot, ready[0].slot);
}

TEST_F(ArenaTest, ChecksumBelongsToOneSeqOnly) {
  auto a = NewArena(3);
  int s = Write(*a, 5, 1);
  EXPECT_FALSE(a->Checksum(s, 5).has_value());
  a->SetChecksum(s, 5, 99);
  EXPECT_EQ(a->Checksum(s, 5).value_or(0), 99u);
  EXPECT_FALSE(a->Checksum(s, 6).has_value());
}

TEST_F(ArenaTest, ForeignOrMissingFilesAreClearErrors) {
  EXPECT_TRUE(SnapshotArena::Open(path_).status().IsNotFound());
  FILE* f = std::fopen(path_.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::string junk(8192, 'x');
  std::fwrite(junk.data(), 1, junk.size(), f);
  std::fclose(f);
  // Others may read it: refused before its content is looked at.
  ASSERT_EQ(::chmod(path_.c_str(), 0644), 0);
  EXPECT_EQ(SnapshotArena::Open(path_).status().code(), Status::Code::kFailedPrecondition);
  ASSERT_EQ(::chmod(path_.c_str(), 0600), 0);
  EXPECT_EQ(SnapshotArena::Open(path_).status().code(), Status::Code::kCorruption);
  EXPECT_EQ(SnapshotArena::Create(path_, 1, 4096, 4096).status().code(),
            Status::Code::kInvalidArgument);
}

}  // namespace
}  // namespace efdl::snapshot
