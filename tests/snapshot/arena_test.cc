#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>

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
  // A writer in another process begins the next commit, copies half of it and is SIGKILLed.
  void KillAWriterMidCopy() {
    pid_t writer = ::fork();
    ASSERT_GE(writer, 0);
    if (writer == 0) {
      auto mine = SnapshotArena::Open(path_);
      if (!mine.ok()) ::_exit(1);
      auto slot = (*mine)->BeginWrite();
      if (!slot.ok()) ::_exit(1);
      std::memset((*mine)->data_area(*slot), 0xEE, 512);  // half a copy, then death
      ::kill(::getpid(), SIGKILL);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(writer, &status, 0), writer);
    ASSERT_TRUE(WIFSIGNALED(status));
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

TEST_F(ArenaTest, WithTwoSlotsAPinnedOlderSlotIsTakenNeverTheNewest) {
  auto a = NewArena();
  int first = Write(*a, 1, 1);
  ASSERT_TRUE(a->Pin(first, 1));
  int second = Write(*a, 2, 2);
  EXPECT_NE(second, first) << "an unpinned slot was free";
  // Only two slots: the older one is pinned (being persisted). The writer takes it (preemption)
  // rather than the newest, and at once: the pin has no hold.
  const auto t0 = std::chrono::steady_clock::now();
  bool preempted = false;
  auto third = a->BeginWrite(std::chrono::seconds(5), &preempted);
  ASSERT_TRUE(third.ok());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1))
      << "a pin without a hold made the writer wait";
  EXPECT_EQ(*third, first) << "the writer took the newest snapshot's slot";
  EXPECT_TRUE(preempted);
  EXPECT_FALSE(a->Unchanged(first, 1)) << "the pinner's seqlock check cannot see the preemption";
  EXPECT_EQ(a->data_area(second)[0], 2) << "the newest snapshot was touched";
  a->Publish(*third, 3, 30, 1, 1024);
  a->Unpin(first);
  EXPECT_FALSE(a->Pin(first, 1)) << "pinning a slot whose seq changed must fail";
}

TEST_F(ArenaTest, WriterKilledMidCopyWithTwoSlotsWhileAPersisterPinsTheOtherKeepsTheNewest) {
  auto a = NewArena(2);
  int older = Write(*a, 1, 0x11);
  // Another live process (the persister) pins the older snapshot for a long write.
  int to_child[2], from_child[2];
  ASSERT_EQ(::pipe(to_child), 0);
  ASSERT_EQ(::pipe(from_child), 0);
  pid_t persister = ::fork();
  ASSERT_GE(persister, 0);
  if (persister == 0) {
    auto mine = SnapshotArena::Open(path_);
    char ok = mine.ok() && (*mine)->Pin(older, 1) ? 'p' : 'x';
    (void)!::write(from_child[1], &ok, 1);
    char c;
    (void)!::read(to_child[0], &c, 1);  // holds the pin until told
    ::_exit(0);
  }
  char pinned = 0;
  ASSERT_EQ(::read(from_child[0], &pinned, 1), 1);
  ASSERT_EQ(pinned, 'p');
  int newest = Write(*a, 2, 0x22);
  ASSERT_NE(newest, older);
  // The next commit: its writer dies half-way through the copy.
  ASSERT_NO_FATAL_FAILURE(KillAWriterMidCopy());
  auto b = SnapshotArena::Open(path_);
  ASSERT_TRUE(b.ok());
  auto ready = (*b)->ReadySlots();
  ASSERT_FALSE(ready.empty());
  EXPECT_EQ(ready[0].seq, 2u) << "the last acknowledged commit is gone";
  EXPECT_EQ(ready[0].slot, newest);
  EXPECT_EQ((*b)->data_area(newest)[0], 0x22);
  EXPECT_EQ((*b)->data_area(newest)[1023], 0x22);
  // The killed writer took the persister's slot: the persister's check says so.
  EXPECT_FALSE((*b)->Unchanged(older, 1));
  char c = 'q';
  ASSERT_EQ(::write(to_child[1], &c, 1), 1);
  int status = 0;
  ASSERT_EQ(::waitpid(persister, &status, 0), persister);
  for (int fd : {to_child[0], to_child[1], from_child[0], from_child[1]}) ::close(fd);
}

TEST_F(ArenaTest, AHeldPinIsWaitedForAtMostTheBoundAndNotAfterItGoes) {
  auto a = NewArena(2);
  int older = Write(*a, 1, 1);
  ASSERT_TRUE(a->Pin(older, 1, /*hold=*/true));
  Write(*a, 2, 2);
  // The pin stays: the writer waits the whole bound, then takes the slot anyway.
  const auto wait = std::chrono::milliseconds(300);
  auto t0 = std::chrono::steady_clock::now();
  bool preempted = false;
  auto slot = a->BeginWrite(wait, &preempted);
  auto took = std::chrono::steady_clock::now() - t0;
  ASSERT_TRUE(slot.ok());
  EXPECT_EQ(*slot, older);
  EXPECT_TRUE(preempted);
  EXPECT_GE(took, wait) << "a held pin was not waited for";
  EXPECT_LT(took, wait + std::chrono::seconds(2)) << "the wait exceeded its bound";
  a->Publish(*slot, 3, 30, 1, 1024);
  // The preempted pinner has not noticed yet: its pin stays, its hold is void (slot `older` is
  // the newest now; the next commit takes the other slot, the one after takes `older` at once).
  Write(*a, 4, 4);
  t0 = std::chrono::steady_clock::now();
  slot = a->BeginWrite(std::chrono::seconds(20), &preempted);
  ASSERT_TRUE(slot.ok());
  EXPECT_EQ(*slot, older);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5))
      << "the writer waited for the hold of a pinner it had preempted already";
  a->Publish(*slot, 5, 50, 1, 1024);
  a->Unpin(older);
  // A held pin released during the wait: the writer gets the slot then, not preempted.
  auto ready = a->ReadySlots();
  ASSERT_EQ(ready.size(), 2u);
  const SlotInfo old2 = ready[1];
  ASSERT_TRUE(a->Pin(old2.slot, old2.seq, /*hold=*/true));
  std::thread release([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    a->Unpin(old2.slot);
  });
  t0 = std::chrono::steady_clock::now();
  slot = a->BeginWrite(std::chrono::seconds(20), &preempted);
  took = std::chrono::steady_clock::now() - t0;
  release.join();
  ASSERT_TRUE(slot.ok());
  EXPECT_EQ(*slot, old2.slot);
  EXPECT_FALSE(preempted);
  EXPECT_GE(took, std::chrono::milliseconds(90));
  EXPECT_LT(took, std::chrono::seconds(10)) << "the writer did not see the pin go";
  a->Abandon(*slot);
}

TEST_F(ArenaTest, DataAreasAreSizedWithoutHeadroom) {
  // 2 slots of 1 MiB data: the file is the header page plus 2 x (manifest page + 1 MiB).
  auto a = SnapshotArena::Create(path_, 2, 4096, 1 << 20);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ((*a)->data_capacity(), uint64_t{1} << 20);
  EXPECT_EQ((*a)->allocated_bytes(), kPageBytes + 2 * (kPageBytes + (uint64_t{1} << 20)));
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
  ASSERT_NO_FATAL_FAILURE(KillAWriterMidCopy());
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
