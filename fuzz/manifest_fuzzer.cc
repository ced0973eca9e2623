// Fuzzes what the snapshot engine reads back from storage. The first input byte picks the mode:
//   even: the rest is a manifest (JSON) for Manifest::Parse and Validate;
//   odd:  the rest is a whole snapshot file. The harness repairs the magic and both hashes (a
//         random input never matches them), so the fuzzer reaches the length fields, the
//         manifest and the data reads behind them.
// Properties: no crash, exception or sanitizer report; nothing reads outside the file.
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "efdl/snapshot.h"
#include "snapshot/env.h"
#include "snapshot/hash.h"
#include "snapshot/snapshot_file.h"

namespace {

using efdl::Status;
using namespace efdl::snapshot;

// The file layout's facts (snapshot_file.cc): a 64-byte header, hashes seeded as below.
constexpr size_t kHeaderBytes = 64;
constexpr size_t kManifestLenAt = 16;
constexpr size_t kManifestHashAt = 40;
constexpr size_t kHeaderHashAt = 56;
constexpr uint64_t kHeaderSeed = 0x5eed0001;
constexpr uint64_t kManifestSeed = 0x5eed0002;

class MemoryFile final : public RandomAccessFile {
 public:
  explicit MemoryFile(std::string bytes) : bytes_(std::move(bytes)) {}
  Status Read(uint64_t offset, size_t n, void* dst) const override {
    if (offset > bytes_.size() || n > bytes_.size() - offset) {
      return Status::Corruption("read past the end of the file");
    }
    std::memcpy(dst, bytes_.data() + offset, n);
    return Status::OK();
  }
  uint64_t Size() const override { return bytes_.size(); }

 private:
  std::string bytes_;
};

void RepairHashes(std::string& file) {
  if (file.size() < kHeaderBytes) return;
  std::memcpy(file.data(), "EFDLSNAP", 8);
  uint64_t manifest_len;
  std::memcpy(&manifest_len, file.data() + kManifestLenAt, 8);
  if (manifest_len <= file.size() - kHeaderBytes) {
    uint64_t h = Hash64(file.data() + kHeaderBytes, manifest_len, kManifestSeed);
    std::memcpy(file.data() + kManifestHashAt, &h, 8);
  }
  uint64_t h = Hash64(file.data(), kHeaderHashAt, kHeaderSeed);
  std::memcpy(file.data() + kHeaderHashAt, &h, 8);
}

void FuzzFile(std::string bytes) {
  RepairHashes(bytes);
  MemoryFile file(std::move(bytes));
  auto info = ReadSnapshotInfo(file, "fuzz.snap");
  if (!info.ok()) return;
  (void)VerifySnapshotData(file, *info, "fuzz.snap", nullptr);
  // Validate() bounded every tensor by data_bytes, which the file holds: these fit in memory.
  std::vector<std::vector<uint8_t>> buffers;
  std::vector<void*> dst;
  for (const auto& t : info->manifest.tensors) {
    buffers.emplace_back(t.nbytes);
    dst.push_back(buffers.back().data());
  }
  (void)ReadSnapshotTensors(file, *info, dst, nullptr);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    auto m = Manifest::Parse(rest);
    if (m.ok()) {
      (void)m->Validate();
      (void)Manifest::Parse(m->Serialize());
    }
  } else {
    FuzzFile(std::move(rest));
  }
  return 0;
}
