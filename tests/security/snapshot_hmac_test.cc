// Stored snapshots with an HMAC keyed by the job's secret: a job restores its own, and refuses a
// file another job wrote (another secret), one without an HMAC, and one whose manifest was
// altered with its checksums recomputed (what the checksums alone cannot catch). The checksum
// itself is verified before every restore: a flipped data byte is refused either way.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <vector>

#include "common/net.h"
#include "efdl/snapshot.h"
#include "security/job_secret.h"
#include "snapshot/env.h"
#include "snapshot/hash.h"
#include "snapshot/snapshot_file.h"
#include "../support/temp_dir_test.h"

namespace efdl::snapshot {
namespace {

class SnapshotHmacTest : public TempDirTest {
 protected:
  SnapshotHmacTest() : TempDirTest("efdl-hmac") {}
  void SetUpInDir() override {
    auto a = security::NewSecret();
    auto b = security::NewSecret();
    ASSERT_TRUE(a.ok() && b.ok());
    secret_a_ = *a;
    secret_b_ = *b;
  }

  // Writes one stored snapshot of `value`s for `job` keyed with `key` into `storage` (the
  // arena is removed afterwards, so restores read storage).
  void WriteSnapshot(const std::string& job, const std::string& key, const std::string& storage,
                     float value, int64_t step) {
    EngineOptions o;
    o.job_id = job;
    o.arena_path = dir_.path() + "/" + job + ".arena";
    o.storage_dir = storage;
    o.hmac_key = key;
    auto e = SnapshotEngine::Open(o);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    std::vector<float> w(kCount, value);
    ASSERT_TRUE((*e)->SetLayout({{"w", "float32", {kCount}, 0, kCount * sizeof(float)}}).ok());
    ASSERT_TRUE((*e)->Commit({{w.data()}}, step, R"({"note": "spaced  json"})").ok());
    ASSERT_TRUE((*e)->Flush(std::chrono::seconds(30)).ok());
    e->reset();
    std::filesystem::remove(o.arena_path);
  }

  // Restores the newest stored snapshot of `storage` with `key`; its status, values in *out.
  Status Restore(const std::string& key, const std::string& storage, std::vector<float>* out) {
    EngineOptions o;
    o.job_id = "reader";
    o.arena_path = dir_.path() + "/reader.arena";
    o.storage_dir = storage;
    o.persist = false;
    o.hmac_key = key;
    auto e = SnapshotEngine::Open(o);
    if (!e.ok()) return e.status();
    auto candidates = (*e)->Candidates();
    if (candidates.empty()) return Status::NotFound("no snapshot in " + storage);
    out->assign(kCount, 0.0f);
    return (*e)->Restore(candidates[0], {out->data()});
  }

  std::string OnlyFile(const std::string& storage) {
    std::vector<std::string> files;
    for (const auto& f : std::filesystem::directory_iterator(storage)) {
      files.push_back(f.path().string());
    }
    EXPECT_EQ(files.size(), 1u);
    return files.empty() ? std::string() : files[0];
  }

  static constexpr int64_t kCount = 4096;
  std::string secret_a_, secret_b_;
};

TEST_F(SnapshotHmacTest, AJobRestoresItsOwnAndRefusesAnotherJobsOrUnsignedFiles) {
  const std::string mine = dir_.path() + "/a";
  WriteSnapshot("a", secret_a_, mine, 3.0f, 7);
  std::vector<float> out;
  Status st = Restore(secret_a_, mine, &out);
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(out, std::vector<float>(kCount, 3.0f));

  // Another job (its own secret) planted a valid-looking snapshot in our directory.
  const std::string theirs = dir_.path() + "/b";
  WriteSnapshot("b", secret_b_, theirs, 9.0f, 8);
  st = Restore(secret_a_, theirs, &out);
  ASSERT_EQ(st.code(), Status::Code::kCorruption) << st.ToString();
  EXPECT_NE(st.message().find("failed its HMAC check"), std::string::npos) << st.message();
  EXPECT_EQ(st.message().find(secret_a_), std::string::npos);
  EXPECT_EQ(st.message().find(secret_b_), std::string::npos);

  const std::string unsigned_dir = dir_.path() + "/u";
  WriteSnapshot("u", "", unsigned_dir, 1.0f, 9);
  st = Restore(secret_a_, unsigned_dir, &out);
  ASSERT_EQ(st.code(), Status::Code::kCorruption) << st.ToString();
  EXPECT_NE(st.message().find("has no HMAC"), std::string::npos) << st.message();
  // With the HMAC off the same file restores (checksums only).
  EXPECT_TRUE(Restore("", unsigned_dir, &out).ok());
}

TEST_F(SnapshotHmacTest, AlteredManifestWithRecomputedChecksumsIsDetected) {
  const std::string mine = dir_.path() + "/a";
  WriteSnapshot("a", secret_a_, mine, 2.0f, 5);
  const std::string path = OnlyFile(mine);
  Env* env = Env::Posix();
  SnapshotFileInfo info;
  std::vector<uint8_t> data;
  {
    auto file = env->NewRandomAccessFile(path);
    ASSERT_TRUE(file.ok());
    auto read = ReadSnapshotInfo(**file, path);
    ASSERT_TRUE(read.ok()) << read.status().ToString();
    info = *read;
    data.resize(info.manifest.data_bytes);
    ASSERT_TRUE((*file)->Read(info.data_offset, data.size(), data.data()).ok());
  }
  ASSERT_FALSE(info.manifest.hmac.empty());
  // Rewrite the file as a forger would: a different step, the old HMAC, valid checksums.
  Manifest forged = info.manifest;
  forged.step = 1000000;
  {
    auto out = env->NewWritableFile(path);
    ASSERT_TRUE(out.ok());
    ASSERT_TRUE(WriteSnapshotFile(out->get(), forged, data.data(), info.data_checksum).ok());
    ASSERT_TRUE((*out)->Close().ok());
  }
  std::vector<float> values;
  EXPECT_TRUE(Restore("", mine, &values).ok()) << "checksums alone accept the forged file";
  Status st = Restore(secret_a_, mine, &values);
  ASSERT_EQ(st.code(), Status::Code::kCorruption) << st.ToString();
  EXPECT_NE(st.message().find("failed its HMAC check"), std::string::npos) << st.message();
}

TEST_F(SnapshotHmacTest, FlippedDataByteIsRefusedBeforeRestore) {
  const std::string mine = dir_.path() + "/a";
  WriteSnapshot("a", secret_a_, mine, 4.0f, 3);
  const std::string path = OnlyFile(mine);
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-100, std::ios::end);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x01);
    f.seekp(-100, std::ios::end);
    f.write(&c, 1);
  }
  for (const std::string& key : {std::string(), secret_a_}) {
    std::vector<float> out(kCount, -1.0f);
    Status st = Restore(key, mine, &out);
    ASSERT_EQ(st.code(), Status::Code::kCorruption) << st.ToString();
    EXPECT_NE(st.message().find("checksum"), std::string::npos) << st.message();
    EXPECT_EQ(out, std::vector<float>(kCount, 0.0f)) << "nothing restored from a corrupt file";
  }
}

}  // namespace
}  // namespace efdl::snapshot
