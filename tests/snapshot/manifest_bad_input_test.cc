// Snapshot files and manifests damaged or written by something else: every one is refused with a
// Corruption status that names the file, never an exception, a huge allocation or a read
// outside the file. (Random bit flips and truncation: store_engine_test.cc.)
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "efdl/snapshot.h"
#include "snapshot/env.h"
#include "snapshot/hash.h"
#include "snapshot/snapshot_file.h"

namespace efdl::snapshot {
namespace {

class MemoryWritable final : public WritableFile {
 public:
  explicit MemoryWritable(std::string* out) : out_(out) {}
  Status Append(const void* data, size_t n) override {
    out_->append(static_cast<const char*>(data), n);
    return Status::OK();
  }
  Status Sync() override { return Status::OK(); }
  Status Close() override { return Status::OK(); }

 private:
  std::string* out_;
};

class MemoryFile final : public RandomAccessFile {
 public:
  explicit MemoryFile(std::string bytes) : bytes_(std::move(bytes)) {}
  Status Read(uint64_t offset, size_t n, void* dst) const override {
    if (offset > bytes_.size() || n > bytes_.size() - offset) {
      return Status::Corruption("read past the end");
    }
    std::memcpy(dst, bytes_.data() + offset, n);
    return Status::OK();
  }
  uint64_t Size() const override { return bytes_.size(); }

 private:
  std::string bytes_;
};

// Header field offsets and hash seeds of the file format (snapshot_file.h/.cc).
constexpr size_t kVersionAt = 8, kManifestLenAt = 16, kDataOffsetAt = 24, kDataLenAt = 32,
                 kManifestHashAt = 40, kDataChecksumAt = 48, kHeaderHashAt = 56, kHeaderBytes = 64;
constexpr uint64_t kHeaderSeed = 0x5eed0001, kManifestSeed = 0x5eed0002;

std::string GoodFile() {
  Manifest m;
  m.job = "j";
  m.seq = 1;
  m.step = 5;
  m.scope = "node";
  m.data_bytes = 64;
  m.tensors = {{"w", "float32", {4}, 0, 16}};
  std::vector<uint8_t> data(64, 7);
  std::string out;
  MemoryWritable file(&out);
  EXPECT_TRUE(WriteSnapshotFile(&file, m, data.data(), 0).ok());
  return out;
}

void Put64(std::string& file, size_t at, uint64_t v) { std::memcpy(file.data() + at, &v, 8); }
uint64_t Get64(const std::string& file, size_t at) {
  uint64_t v;
  std::memcpy(&v, file.data() + at, 8);
  return v;
}

// Recomputes both hashes, as a writer that meant to produce this file would have.
void Rehash(std::string& file) {
  uint64_t len = Get64(file, kManifestLenAt);
  if (len <= file.size() - kHeaderBytes) {
    Put64(file, kManifestHashAt, Hash64(file.data() + kHeaderBytes, len, kManifestSeed));
  }
  Put64(file, kHeaderHashAt, Hash64(file.data(), kHeaderHashAt, kHeaderSeed));
}

void ExpectCorruption(const std::string& bytes, const std::string& what) {
  MemoryFile file(bytes);
  auto info = ReadSnapshotInfo(file, "/snap/x.snap");
  ASSERT_FALSE(info.ok()) << what;
  EXPECT_EQ(info.status().code(), Status::Code::kCorruption) << what;
  EXPECT_NE(info.status().message().find("/snap/x.snap"), std::string::npos)
      << what << ": " << info.status().ToString();
}

TEST(SnapshotFileBadInputTest, TheGoodFileReads) {
  MemoryFile file(GoodFile());
  EXPECT_TRUE(ReadSnapshotInfo(file, "x").ok());
}

TEST(SnapshotFileBadInputTest, LyingLengthsWithValidHashesAreCorruption) {
  const uint64_t huge = ~uint64_t{0} - 7;
  struct Case {
    const char* what;
    size_t field;
    uint64_t value;
  };
  for (const Case& c : std::vector<Case>{
           {"manifest length near 2^64 (wraps the bounds check)", kManifestLenAt, huge},
           {"manifest length past the end", kManifestLenAt, 1 << 20},
           {"data offset near 2^64", kDataOffsetAt, huge},
           {"data length near 2^64 (wraps offset + length)", kDataLenAt, huge},
           {"data length past the end", kDataLenAt, 1 << 20},
           {"data offset inside the manifest", kDataOffsetAt, 70},
       }) {
    std::string bytes = GoodFile();
    Put64(bytes, c.field, c.value);
    Rehash(bytes);
    ExpectCorruption(bytes, c.what);
  }
}

// GoodFile's data region replaced by `data` (64 bytes; its one tensor is the first 16), with the
// data checksum of format `version`, as that version's writer produced it.
std::string FileOfVersion(uint32_t version, const std::vector<uint8_t>& data) {
  std::string bytes = GoodFile();
  bytes.replace(bytes.size() - data.size(), data.size(),
                reinterpret_cast<const char*>(data.data()), data.size());
  const uint64_t piece = PieceHash(static_cast<int>(version), data.data(), 16, Piece{}.Seed());
  Put64(bytes, kDataChecksumAt, FoldPieceHashes({piece}));
  std::memcpy(bytes.data() + kVersionAt, &version, 4);
  Rehash(bytes);
  return bytes;
}

TEST(SnapshotFileFormatTest, FilesOfFormat1StillVerifyWithTheirOwnHash) {
  std::vector<uint8_t> data(64);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 13 + 1);
  for (uint32_t version : {1u, 2u}) {
    MemoryFile file(FileOfVersion(version, data));
    auto info = ReadSnapshotInfo(file, "x.snap");
    ASSERT_TRUE(info.ok()) << version << ": " << info.status().ToString();
    EXPECT_EQ(info->format, static_cast<int>(version));
    EXPECT_TRUE(VerifySnapshotData(file, *info, "x.snap", nullptr).ok()) << version;
    std::vector<uint8_t> back(16);
    ASSERT_TRUE(ReadSnapshotTensors(file, *info, {back.data()}, nullptr).ok());
    EXPECT_TRUE(std::equal(back.begin(), back.end(), data.begin()));
  }
  // The checksum is read as its version's hash, not the other one.
  std::string v1 = FileOfVersion(1, data);
  uint32_t two = 2;
  std::memcpy(v1.data() + kVersionAt, &two, 4);
  Rehash(v1);
  MemoryFile file(v1);
  auto info = ReadSnapshotInfo(file, "x.snap");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(VerifySnapshotData(file, *info, "x.snap", nullptr).code(),
            Status::Code::kCorruption);
  // What this EFDL writes is format 2, with the checksum ChecksumOfRegion gives.
  MemoryFile fresh(GoodFile());
  auto fresh_info = ReadSnapshotInfo(fresh, "x.snap");
  ASSERT_TRUE(fresh_info.ok());
  EXPECT_EQ(fresh_info->format, kCurrentDataFormat);
}

TEST(SnapshotFileFormatTest, VersionsThisEfdlDoesNotKnowAreCorruptionNamingTheVersion) {
  for (uint32_t version : {0u, 3u, 77u}) {
    std::string bytes = GoodFile();
    std::memcpy(bytes.data() + kVersionAt, &version, 4);
    Rehash(bytes);
    MemoryFile file(bytes);
    auto info = ReadSnapshotInfo(file, "/snap/x.snap");
    ASSERT_FALSE(info.ok()) << version;
    EXPECT_EQ(info.status().code(), Status::Code::kCorruption);
    EXPECT_NE(info.status().message().find("version " + std::to_string(version)),
              std::string::npos)
        << info.status().ToString();
  }
}

TEST(SnapshotFileBadInputTest, ManifestsOfTheWrongShapeAreCorruption) {
  const std::string head = R"({"format":"efdl-snapshot/1","job":"j","seq":1,"step":1,)"
                           R"("wall_time":1.0,"data_bytes":64,)";
  const std::vector<std::string> manifests = {
      "",
      "not json",
      "[]",
      R"({"format":5})",
      R"({"format":null,"job":"j"})",
      R"({"format":"efdl-snapshot/2"})",
      R"({"format":"efdl-snapshot/1","job":7})",
      // Integers that do not fit: a float cast would be undefined behaviour, a negative wraps.
      R"({"format":"efdl-snapshot/1","job":"j","seq":1e300,"step":1,"wall_time":1,)"
      R"("data_bytes":0,"tensors":[]})",
      R"({"format":"efdl-snapshot/1","job":"j","seq":-1,"step":1,"wall_time":1,)"
      R"("data_bytes":0,"tensors":[]})",
      R"({"format":"efdl-snapshot/1","job":"j","seq":1,"step":18446744073709551615,)"
      R"("wall_time":1,"data_bytes":0,"tensors":[]})",
      head + R"("tensors":[{"name":"w","dtype":"f","shape":[-1e300],"offset":0,"nbytes":4}]})",
      head + R"("tensors":"none"})",
      head + R"("tensors":[5]})",
      head + R"("tensors":[{"name":"w","dtype":"f","shape":[1.5],"offset":0,"nbytes":4}]})",
      head + R"("tensors":[{"name":"w","dtype":"f","shape":[1],"offset":"0","nbytes":4}]})",
      head + R"("tensors":[{"name":"w","dtype":"f","shape":[1],"offset":60,"nbytes":8}]})",
      head + R"("tensors":[{"name":"a","dtype":"f","shape":[1],"offset":0,"nbytes":8},)"
             R"({"name":"b","dtype":"f","shape":[1],"offset":4,"nbytes":8}]})",
  };
  for (const auto& text : manifests) {
    auto m = Manifest::Parse(text);
    Status s = m.ok() ? m->Validate() : m.status();
    EXPECT_EQ(s.code(), Status::Code::kCorruption) << text;
    EXPECT_FALSE(s.message().empty()) << text;
  }
}

}  // namespace
}  // namespace efdl::snapshot
