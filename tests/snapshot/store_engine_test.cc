#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <numeric>
#include <thread>

#include "common/net.h"
#include "efdl/snapshot.h"
#include "snapshot/arena.h"
#include "snapshot/layout.h"
#include "snapshot/persister.h"
#include "snapshot/store.h"
#include "tests/snapshot/fault_env.h"
#include "../support/temp_dir_test.h"

namespace efdl::snapshot {
namespace {

using testing::FaultEnv;

Manifest MakeManifest(uint64_t seq, std::vector<uint8_t>* data, uint8_t fill) {
  Manifest m;
  m.job = "j";
  m.seq = seq;
  m.step = static_cast<int64_t>(seq);
  m.tensors = {{"a", "uint8", {1000}, 0, 1000}, {"b", "uint8", {3000}, 0, 3000}};
  m.data_bytes = AssignOffsets(m.tensors);
  data->assign(m.data_bytes, fill);
  for (size_t i = 0; i < data->size(); ++i) (*data)[i] = static_cast<uint8_t>(fill + i);
  return m;
}

Status WriteOne(SnapshotStore& store, uint64_t seq, uint8_t fill) {
  std::vector<uint8_t> data;
  Manifest m = MakeManifest(seq, &data, fill);
  return store.Write(m, data.data(), ChecksumOfRegion(m.tensors, data.data(), nullptr));
}

class StoreTest : public TempDirTest {
 protected:
  StoreTest() : TempDirTest("efdl-store-test") {}
  std::string Dir() const { return dir_.path() + "/job"; }
  FaultEnv env_;
};

TEST_F(StoreTest, WritesVerifiableFilesAndKeepsTheLastK) {
  SnapshotStore store(&env_, Dir(), 2);
  for (uint64_t seq = 1; seq <= 4; ++seq) ASSERT_TRUE(WriteOne(store, seq, 7).ok());
  auto list = store.List();
  ASSERT_EQ(list.size(), 2u);
  EXPECT_EQ(list[0].seq, 4u);
  EXPECT_EQ(list[1].seq, 3u);
  for (const auto& e : list) EXPECT_TRUE(store.Verify(e.path, nullptr).ok()) << e.path;
  auto names = env_.GetChildren(Dir());
  ASSERT_TRUE(names.ok());
  EXPECT_EQ(names->size(), 2u) << "temporaries left behind";
}

TEST_F(StoreTest, CrashBetweenWriteAndRenameKeepsThePreviousSnapshot) {
  SnapshotStore store(&env_, Dir(), 2);
  ASSERT_TRUE(WriteOne(store, 1, 1).ok());
  env_.fail_rename = true;
  EXPECT_FALSE(WriteOne(store, 2, 2).ok());
  env_.fail_rename = false;
  auto list = store.List();
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].seq, 1u);
  EXPECT_TRUE(store.Verify(list[0].path, nullptr).ok());
  // A real crash leaves its temporary; the next writer on this host removes it (its pid is gone).
  std::string stale = Dir() + "/.tmp-" + HostName() + "-999999999-2.efdl";
  std::ofstream(stale) << "partial";
  ASSERT_TRUE(WriteOne(store, 3, 3).ok());
  EXPECT_FALSE(env_.FileExists(stale));
  EXPECT_EQ(store.List().front().seq, 3u);
}

TEST_F(StoreTest, AWriteRefusedRightBeforePublishingLeavesNothingBehind) {
  SnapshotStore store(&env_, Dir(), 2);
  ASSERT_TRUE(WriteOne(store, 1, 1).ok());
  std::vector<uint8_t> data;
  Manifest m = MakeManifest(2, &data, 2);
  uint64_t asked_seq = 0;
  Status s = store.Write(m, data.data(), ChecksumOfRegion(m.tensors, data.data(), nullptr),
                         [&](const Manifest& about) {
                           asked_seq = about.seq;
                           return Status::FailedPrecondition("the lease expired");
                         });
  EXPECT_EQ(asked_seq, 2u);
  EXPECT_TRUE(s.IsFailedPrecondition()) << s.ToString();
  EXPECT_NE(s.message().find("not publishing snapshot seq 2: the lease expired"),
            std::string::npos)
      << s.message();
  ASSERT_EQ(store.List().size(), 1u);
  EXPECT_EQ(env_.GetChildren(Dir())->size(), 1u) << "the refused temporary was left behind";
  // Allowed, the same write publishes.
  EXPECT_TRUE(store.Write(m, data.data(), ChecksumOfRegion(m.tensors, data.data(), nullptr),
                          [](const Manifest&) { return Status::OK(); })
                  .ok());
  EXPECT_EQ(store.List().front().seq, 2u);
}

TEST_F(StoreTest, FullDiskIsReportedAndThePreviousSnapshotIsKept) {
  SnapshotStore store(&env_, Dir(), 2);
  ASSERT_TRUE(WriteOne(store, 1, 1).ok());
  env_.space_left = 2000;  // less than one snapshot
  Status s = WriteOne(store, 2, 2);
  EXPECT_EQ(s.code(), Status::Code::kIOError);
  EXPECT_NE(s.message().find("no space left"), std::string::npos) << s.message();
  env_.space_left = -1;
  auto list = store.List();
  ASSERT_EQ(list.size(), 1u);
  EXPECT_TRUE(store.Verify(list[0].path, nullptr).ok());
  EXPECT_EQ(env_.GetChildren(Dir())->size(), 1u) << "partial temporary left behind";
}

TEST_F(StoreTest, TruncatedAndBitFlippedFilesAreCorruption) {
  SnapshotStore store(&env_, Dir(), 3);
  ASSERT_TRUE(WriteOne(store, 1, 1).ok());
  ASSERT_TRUE(WriteOne(store, 2, 2).ok());
  const std::string p1 = store.List()[1].path, p2 = store.List()[0].path;
  ASSERT_EQ(::truncate(p2.c_str(), 5000), 0);
  EXPECT_EQ(store.ReadInfo(p2).status().code(), Status::Code::kCorruption);
  ASSERT_EQ(::truncate(p2.c_str(), 30), 0);
  EXPECT_EQ(store.ReadInfo(p2).status().code(), Status::Code::kCorruption);
  {
    std::fstream f(p1, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(4096 + 1500);
    f.put('\x7f');
  }
  EXPECT_TRUE(store.ReadInfo(p1).ok()) << "header and manifest are intact";
  EXPECT_EQ(store.Verify(p1, nullptr).code(), Status::Code::kCorruption);
}

class EngineTest : public StoreTest {
 protected:
  void SetUp() override {
    StoreTest::SetUp();
    arena_ = dir_.path() + "/e.arena";
  }
  std::unique_ptr<SnapshotEngine> Open(bool persist = true) {
    EngineOptions o;
    o.job_id = "j";
    o.arena_path = arena_;
    o.storage_dir = Dir();
    o.persist = persist;
    o.env = &env_;
    auto e = SnapshotEngine::Open(o);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return std::move(e).value();
  }
  static std::vector<TensorEntry> Layout(size_t n) {
    return {{"w", "float32", {static_cast<int64_t>(n)}, 0, n * 4}, {"step", "int64", {}, 0, 8}};
  }
  static Result<uint64_t> CommitValues(SnapshotEngine& e, const std::vector<float>& w,
                                       int64_t step) {
    return e.Commit({{w.data()}, {&step}}, step, R"({"k":1})");
  }
  std::string arena_;
};

TEST_F(EngineTest, ACommitWithoutTensorsIsAValidSnapshot) {
  {
    auto e = Open(/*persist=*/false);
    ASSERT_TRUE(e->SetLayout({}).ok());  // the same (empty) layout the engine starts with
    ASSERT_TRUE(e->Commit({}, 4, R"({"k":1})").ok());
  }
  auto c = Open(false)->Candidates();
  ASSERT_EQ(c.size(), 1u) << "the manifest of a tensor-less commit did not parse";
  EXPECT_EQ(c[0].manifest.step, 4);
  EXPECT_TRUE(c[0].manifest.tensors.empty());
}

TEST_F(EngineTest, RestoresTheNewestCommitFromMemoryAfterTheWriterIsGone) {
  std::vector<float> w(5000);
  {
    auto e = Open(/*persist=*/false);
    ASSERT_TRUE(e->SetLayout(Layout(w.size())).ok());
    for (int64_t step = 1; step <= 3; ++step) {
      std::iota(w.begin(), w.end(), static_cast<float>(step));
      ASSERT_TRUE(CommitValues(*e, w, step).ok());
    }
  }
  auto e = Open(false);
  auto c = e->Candidates();
  ASSERT_FALSE(c.empty());
  EXPECT_EQ(c[0].source, SnapshotRef::Source::kMemory);
  EXPECT_EQ(c[0].manifest.step, 3);
  EXPECT_EQ(c[0].manifest.meta_json, R"({"k":1})");
  EXPECT_GT(c[0].manifest.wall_time, 1.6e9) << "commit time missing from the manifest";
  EXPECT_EQ(c[0].manifest.tensors.size(), 2u);
  EXPECT_EQ(c[0].manifest.tensors[0].name, "w");
  std::vector<float> out(w.size());
  int64_t step = 0;
  ASSERT_TRUE(e->Restore(c[0], {out.data(), &step}).ok());
  EXPECT_EQ(out, w);
  EXPECT_EQ(step, 3);
  EXPECT_EQ(e->next_seq(), 4u) << "seq must continue after a restart";
}

TEST_F(EngineTest, FlushPersistsAndStorageRestoreVerifiesTheChecksum) {
  std::vector<float> w(300000);
  std::iota(w.begin(), w.end(), 0.5f);
  {
    auto e = Open();
    ASSERT_TRUE(e->SetLayout(Layout(w.size())).ok());
    ASSERT_TRUE(CommitValues(*e, w, 7).ok());
    ASSERT_TRUE(e->Flush(std::chrono::seconds(30)).ok());
  }
  ASSERT_EQ(::unlink(arena_.c_str()), 0);  // the node is gone: only storage is left
  auto e = Open(false);
  auto c = e->Candidates();
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].source, SnapshotRef::Source::kStorage);
  std::vector<float> out(w.size());
  int64_t step = 0;
  ASSERT_TRUE(e->Restore(c[0], {out.data(), &step}).ok());
  EXPECT_EQ(out, w);
  EXPECT_EQ(step, 7);
}

TEST_F(EngineTest, CorruptNewestFileIsRejectedBeforeTouchingTheDestination) {
  std::vector<float> w(1000, 1.0f);
  {
    auto e = Open();
    ASSERT_TRUE(e->SetLayout(Layout(w.size())).ok());
    ASSERT_TRUE(CommitValues(*e, w, 1).ok());
    ASSERT_TRUE(e->Flush(std::chrono::seconds(30)).ok());
    std::fill(w.begin(), w.end(), 2.0f);
    ASSERT_TRUE(CommitValues(*e, w, 2).ok());
    ASSERT_TRUE(e->Flush(std::chrono::seconds(30)).ok());
  }
  ::unlink(arena_.c_str());
  SnapshotStore store(&env_, Dir(), 2);
  {
    std::fstream f(store.List()[0].path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(4096 + 100);
    f.put('\x01');
  }
  auto e = Open(false);
  auto c = e->Candidates();
  ASSERT_EQ(c.size(), 2u);
  std::vector<float> out(w.size(), -1.0f);
  int64_t step = -1;
  EXPECT_EQ(e->Restore(c[0], {out.data(), &step}).code(), Status::Code::kCorruption);
  EXPECT_EQ(out[0], -1.0f) << "a corrupt snapshot wrote into the destination";
  ASSERT_TRUE(e->Restore(c[1], {out.data(), &step}).ok());
  EXPECT_EQ(out[999], 1.0f);
  EXPECT_EQ(step, 1);
}

TEST_F(EngineTest, FullDiskDoesNotStopCommitsAndIsReported) {
  std::vector<float> w(100000, 3.0f);
  auto e = Open();
  ASSERT_TRUE(e->SetLayout(Layout(w.size())).ok());
  ASSERT_TRUE(CommitValues(*e, w, 1).ok());
  ASSERT_TRUE(e->Flush(std::chrono::seconds(30)).ok());
  env_.space_left = 10000;
  for (int64_t step = 2; step < 20; ++step) ASSERT_TRUE(CommitValues(*e, w, step).ok());
  Status s = e->Flush(std::chrono::seconds(30));
  EXPECT_EQ(s.code(), Status::Code::kIOError) << s.ToString();
  EXPECT_NE(e->LastPersistStatus().message().find("no space left"), std::string::npos);
  SnapshotStore store(&env_, Dir(), 2);
  ASSERT_EQ(store.List().size(), 1u);
  EXPECT_EQ(store.List()[0].seq, 1u);
  EXPECT_TRUE(store.Verify(store.List()[0].path, nullptr).ok());
  env_.space_left = -1;  // space freed: the next flush catches up
  ASSERT_TRUE(CommitValues(*e, w, 20).ok());
  ASSERT_TRUE(e->Flush(std::chrono::seconds(30)).ok());
  EXPECT_TRUE(e->LastPersistStatus().ok());
}

TEST_F(EngineTest, GrowingTheStateReplacesTheArenaAndKeepsRestoring) {
  auto e = Open(false);
  std::vector<float> small(10, 1.0f), big(200000, 2.0f);
  ASSERT_TRUE(e->SetLayout(Layout(small.size())).ok());
  ASSERT_TRUE(CommitValues(*e, small, 1).ok());
  ASSERT_TRUE(e->SetLayout(Layout(big.size())).ok());
  ASSERT_TRUE(CommitValues(*e, big, 2).ok());
  auto c = e->Candidates();
  ASSERT_FALSE(c.empty());
  EXPECT_EQ(c[0].manifest.step, 2);
  std::vector<float> out(big.size());
  int64_t step = 0;
  ASSERT_TRUE(e->Restore(c[0], {out.data(), &step}).ok());
  EXPECT_EQ(out, big);
  EXPECT_EQ(e->Commit({{nullptr}}, 3, "{}").status().code(), Status::Code::kInvalidArgument);
}

TEST_F(EngineTest, CommitsContinueWhileAReaderHoldsASlot) {
  auto e = Open(false);
  std::vector<float> w(1000, 1.0f);
  ASSERT_TRUE(e->SetLayout(Layout(w.size())).ok());
  ASSERT_TRUE(CommitValues(*e, w, 1).ok());
  auto arena = SnapshotArena::Open(arena_);
  ASSERT_TRUE(arena.ok());
  auto held = (*arena)->ReadySlots().at(0);
  ASSERT_TRUE((*arena)->Pin(held.slot, held.seq));  // as the persister does
  for (int64_t step = 2; step < 6; ++step) {
    std::fill(w.begin(), w.end(), static_cast<float>(step));
    ASSERT_TRUE(CommitValues(*e, w, step).ok());
  }
  EXPECT_TRUE((*arena)->StillReady(held.slot, held.seq));
  float first;
  std::memcpy(&first, (*arena)->data_area(held.slot), sizeof(first));
  EXPECT_EQ(first, 1.0f);
  EXPECT_EQ(e->Candidates().at(0).manifest.step, 5);
  (*arena)->Unpin(held.slot);
}

TEST_F(EngineTest, ArenaDataAreasAreTheStateSizeWithoutHeadroom) {
  auto e = Open(false);
  std::vector<float> w(3 << 20, 1.0f);  // 12 MiB + the step
  ASSERT_TRUE(e->SetLayout(Layout(w.size())).ok());
  ASSERT_TRUE(CommitValues(*e, w, 1).ok());
  auto arena = SnapshotArena::Open(arena_);
  ASSERT_TRUE(arena.ok());
  const uint64_t state = AlignUp(w.size() * 4, kTensorAlign) + 8;
  EXPECT_EQ((*arena)->data_capacity(), AlignUp(state, kPageBytes));
  // The whole file: 3 slots of (manifest area + data) and the header page, nothing else.
  EXPECT_LT((*arena)->allocated_bytes(),
            kPageBytes + 3 * ((*arena)->manifest_capacity() + AlignUp(state, kPageBytes)) +
                (uint64_t{64} << 10));
}

// Two slots, a persister writing the older one to storage: commits take its slot (they never
// write into the newest), the persister discards what it read and writes the newest next.
class PreemptionTest : public EngineTest {
 protected:
  std::unique_ptr<SnapshotEngine> OpenTwoSlots() {
    EngineOptions o;
    o.job_id = "j";
    o.arena_path = arena_;
    o.storage_dir = Dir();
    o.persist = false;
    o.num_slots = 2;
    o.env = &env_;
    auto e = SnapshotEngine::Open(o);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return std::move(e).value();
  }
  std::unique_ptr<Persister> NewPersister() {
    PersisterOptions p;
    p.arena_path = arena_;
    p.storage_dir = Dir();
    p.env = &env_;
    return std::make_unique<Persister>(std::move(p));
  }
  std::vector<float> w_ = std::vector<float>(5 << 20);  // 20 MiB: three 8 MiB chunks
  void Commit(SnapshotEngine& e, int64_t step) {
    std::fill(w_.begin(), w_.end(), static_cast<float>(step));
    ASSERT_TRUE(CommitValues(e, w_, step).ok());
  }
  // Every file in storage verifies and holds the values of its step.
  void ExpectStorageConsistent() {
    SnapshotStore store(&env_, Dir(), 2);
    for (const auto& entry : store.List()) {
      EXPECT_TRUE(store.Verify(entry.path, nullptr).ok()) << entry.path << " is torn";
    }
    auto names = env_.GetChildren(Dir());
    ASSERT_TRUE(names.ok());
    for (const auto& n : *names) EXPECT_FALSE(n.starts_with(".tmp")) << n << " left behind";
  }
};

TEST_F(PreemptionTest, APersisterWhoseSlotACommitTookPublishesNothingAndThenWritesTheNewest) {
  auto e = OpenTwoSlots();
  ASSERT_TRUE(e->SetLayout(Layout(w_.size())).ok());
  Commit(*e, 1);
  Commit(*e, 2);
  auto persister = NewPersister();
  // While the persister writes step 2's slot (pinned, no hold), two commits: step 3 goes to the
  // free slot, step 4 must take the persister's (the other one is the newest, step 3).
  bool armed = true;
  env_.after_append = [&](uint64_t written) {
    if (!armed || written < (uint64_t{8} << 20)) return;
    armed = false;
    Commit(*e, 3);
    Commit(*e, 4);
  };
  auto r = persister->PersistNewestOnce();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_FALSE(*r) << "a write whose slot was taken reported success";
  EXPECT_FALSE(armed);
  EXPECT_EQ(persister->preemptions(), 1u);
  EXPECT_TRUE(SnapshotStore(&env_, Dir(), 2).List().empty()) << "a torn snapshot was published";
  ExpectStorageConsistent();
  // The next try writes the newest snapshot, step 4, whole.
  r = persister->PersistNewestOnce();
  ASSERT_TRUE(r.ok() && *r) << r.status().ToString();
  auto c = e->Candidates();
  auto stored = std::find_if(c.begin(), c.end(), [](const SnapshotRef& ref) {
    return ref.source == SnapshotRef::Source::kStorage;
  });
  ASSERT_NE(stored, c.end());
  EXPECT_EQ(stored->manifest.step, 4);
  std::vector<float> out(w_.size());
  int64_t step = 0;
  ASSERT_TRUE(e->Restore(*stored, {out.data(), &step}).ok());
  EXPECT_EQ(out, w_);
  ExpectStorageConsistent();
}

TEST_F(PreemptionTest, AfterTwoPreemptionsThePersisterHoldsAndACommitWaitsForItBounded) {
  auto e = OpenTwoSlots();
  ASSERT_TRUE(e->SetLayout(Layout(w_.size())).ok());
  Commit(*e, 1);
  Commit(*e, 2);
  auto persister = NewPersister();
  int64_t step = 2;
  int preempt = kHoldAfterPreemptions;
  env_.after_append = [&](uint64_t written) {
    if (preempt == 0 || written < (uint64_t{8} << 20)) return;
    --preempt;
    Commit(*e, ++step);
    Commit(*e, ++step);
  };
  for (int i = 0; i < kHoldAfterPreemptions; ++i) {
    auto r = persister->PersistNewestOnce();
    ASSERT_TRUE(r.ok() && !*r) << "try " << i << ": " << r.status().ToString();
  }
  EXPECT_EQ(persister->preemptions(), static_cast<uint64_t>(kHoldAfterPreemptions));
  EXPECT_TRUE(SnapshotStore(&env_, Dir(), 2).List().empty());
  // The next try holds its slot: two commits from another thread meanwhile; the second waits
  // until the persister has the data in its file (not until its sync), at most kMaxHoldWait.
  const int64_t held_step = step;
  std::thread committer;
  std::chrono::steady_clock::duration waited{};
  std::atomic<bool> second{false};
  bool started = false;
  env_.after_append = [&](uint64_t written) {
    if (started || written < (uint64_t{8} << 20)) return;
    started = true;
    committer = std::thread([&] {
      Commit(*e, held_step + 1);
      second = true;
      const auto t0 = std::chrono::steady_clock::now();
      Commit(*e, held_step + 2);
      waited = std::chrono::steady_clock::now() - t0;
    });
    while (!second) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::this_thread::sleep_for(std::chrono::milliseconds(150));  // the second commit waits
  };
  auto r = persister->PersistNewestOnce();
  committer.join();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(*r) << "the held write was preempted";
  EXPECT_EQ(persister->persisted_seq(), static_cast<uint64_t>(held_step));  // seq == step here
  EXPECT_EQ(persister->preemptions(), static_cast<uint64_t>(kHoldAfterPreemptions));
  EXPECT_GE(waited, std::chrono::milliseconds(100)) << "the commit did not wait for the hold";
  EXPECT_LT(waited, kMaxHoldWait + std::chrono::seconds(1)) << "the wait exceeded its bound";
  EXPECT_EQ(e->Candidates().at(0).manifest.step, held_step + 2);
  ExpectStorageConsistent();
}

TEST(EngineOptions, BadOptionsAreInvalidArgument) {
  EngineOptions o;
  EXPECT_EQ(SnapshotEngine::Open(o).status().code(), Status::Code::kInvalidArgument);
  o.job_id = "j";
  o.arena_path = "/tmp/x.arena";
  o.num_slots = 9;
  EXPECT_EQ(SnapshotEngine::Open(o).status().code(), Status::Code::kInvalidArgument);
  o.num_slots = 2;
  o.keep = 0;
  EXPECT_EQ(SnapshotEngine::Open(o).status().code(), Status::Code::kInvalidArgument);
}

}  // namespace
}  // namespace efdl::snapshot
