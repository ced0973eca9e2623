#include "snapshot/snapshot_file.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>

#include <fmt/format.h>

#include "common/thread_annotations.h"
#include "snapshot/hash.h"
#include "snapshot/layout.h"

namespace efdl::snapshot {

namespace {

constexpr char kMagic[8] = {'E', 'F', 'D', 'L', 'S', 'N', 'A', 'P'};
// Version 2: data pieces hashed with DataHash64 (version 1: Hash64; still read). The header and
// manifest hashes are Hash64 in both.
constexpr uint32_t kVersion = 2;
constexpr uint32_t kOldestReadable = 1;
static_assert(kVersion == kCurrentDataFormat);
constexpr uint64_t kHeaderSeed = 0x5eed0001;
constexpr uint64_t kManifestSeed = 0x5eed0002;

struct FileHeader {
  char magic[8];
  uint32_t version;
  uint32_t header_bytes;
  uint64_t manifest_len;
  uint64_t data_offset;
  uint64_t data_len;
  uint64_t manifest_hash;
  uint64_t data_checksum;
  uint64_t header_hash;  // Hash64 of the bytes before this field
};
static_assert(sizeof(FileHeader) == 64);

// Runs fn over pieces with the first failure kept.
Status ForEachPiece(const std::vector<Piece>& pieces, ParallelRunner* runner,
                    const std::function<Status(size_t)>& fn) {
  struct {
    Mutex mu;
    Status first EFDL_GUARDED_BY(mu);
  } result;
  std::atomic<bool> failed{false};
  auto body = [&](size_t i) {
    if (failed.load(std::memory_order_relaxed)) return;
    Status s = fn(i);
    if (!s.ok()) {
      MutexLock lock(result.mu);
      if (result.first.ok()) result.first = s;
      failed = true;
    }
  };
  if (runner != nullptr) {
    runner->Run(pieces.size(), body);
  } else {
    for (size_t i = 0; i < pieces.size(); ++i) body(i);
  }
  MutexLock lock(result.mu);
  return result.first;
}

}  // namespace

ScratchPool::ScratchPool(size_t count, size_t bytes)
    : bytes_(bytes), buffers_(count), busy_(count) {
  for (auto& b : buffers_) b.reset(new uint8_t[bytes_]);
}

int ScratchPool::Acquire() {
  for (size_t i = 0;; i = (i + 1) % busy_.size()) {
    bool expected = false;
    if (busy_[i].compare_exchange_weak(expected, true, std::memory_order_acquire)) {
      return static_cast<int>(i);
    }
  }
}

uint64_t ChecksumOfRegion(const std::vector<TensorEntry>& tensors, const uint8_t* data,
                          ParallelRunner* runner) {
  auto pieces = PiecesOf(tensors);
  std::vector<uint64_t> hashes(pieces.size());
  auto body = [&](size_t i) {
    hashes[i] = DataHash64(data + pieces[i].offset, pieces[i].length, pieces[i].Seed());
  };
  if (runner != nullptr) {
    runner->Run(pieces.size(), body);
  } else {
    for (size_t i = 0; i < pieces.size(); ++i) body(i);
  }
  return FoldPieceHashes(hashes);
}

Status WriteSnapshotFile(WritableFile* file, const Manifest& manifest, const uint8_t* data,
                         uint64_t data_checksum, const std::function<Status()>& after_chunk) {
  const std::string text = manifest.Serialize();
  FileHeader h{};
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  h.version = kVersion;
  h.header_bytes = sizeof(FileHeader);
  h.manifest_len = text.size();
  h.data_offset = AlignUp(sizeof(FileHeader) + text.size(), uint64_t{4096});
  h.data_len = manifest.data_bytes;
  h.manifest_hash = Hash64(text.data(), text.size(), kManifestSeed);
  h.data_checksum = data_checksum;
  h.header_hash = Hash64(&h, offsetof(FileHeader, header_hash), kHeaderSeed);
  EFDL_RETURN_IF_ERROR(file->Append(&h, sizeof(h)));
  EFDL_RETURN_IF_ERROR(file->Append(text.data(), text.size()));
  std::string pad(h.data_offset - sizeof(FileHeader) - text.size(), '\0');
  EFDL_RETURN_IF_ERROR(file->Append(pad.data(), pad.size()));
  // Large appends in 8 MiB pieces: bounded syscalls, and an injected fault can hit mid-data.
  constexpr uint64_t kChunk = uint64_t{8} << 20;
  for (uint64_t off = 0; off < h.data_len; off += kChunk) {
    EFDL_RETURN_IF_ERROR(file->Append(data + off, std::min(kChunk, h.data_len - off)));
    if (after_chunk) EFDL_RETURN_IF_ERROR(after_chunk());
  }
  return Status::OK();
}

Result<SnapshotFileInfo> ReadSnapshotInfo(const RandomAccessFile& file, const std::string& path) {
  FileHeader h{};
  if (file.Size() < sizeof(h)) {
    return Status::Corruption(fmt::format("{} is truncated (no header)", path));
  }
  EFDL_RETURN_IF_ERROR(file.Read(0, sizeof(h), &h));
  if (std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0) {
    return Status::Corruption(fmt::format("{} is not an EFDL snapshot file", path));
  }
  if (h.header_hash != Hash64(&h, offsetof(FileHeader, header_hash), kHeaderSeed)) {
    return Status::Corruption(fmt::format("{} has a damaged header", path));
  }
  if (h.version < kOldestReadable || h.version > kVersion) {
    return Status::Corruption(
        fmt::format("{} has snapshot format version {}, this EFDL reads {} to {}", path,
                    h.version, kOldestReadable, kVersion));
  }
  // Each bound is checked before it is used in a sum, so huge lengths cannot wrap past a check.
  if (h.manifest_len > file.Size() || h.data_offset < sizeof(h) + h.manifest_len ||
      h.data_offset > file.Size() || h.data_len > file.Size() - h.data_offset) {
    return Status::Corruption(fmt::format("{} is truncated ({} of {} bytes)", path, file.Size(),
                                          h.data_offset + h.data_len));
  }
  std::string text(h.manifest_len, '\0');
  EFDL_RETURN_IF_ERROR(file.Read(sizeof(h), text.size(), text.data()));
  if (Hash64(text.data(), text.size(), kManifestSeed) != h.manifest_hash) {
    return Status::Corruption(fmt::format("{} has a damaged manifest", path));
  }
  auto manifest = Manifest::Parse(text);
  if (!manifest.ok()) return manifest.status().WithContext(path);
  if (manifest->data_bytes != h.data_len) {
    return Status::Corruption(fmt::format("{}: manifest and header disagree on size", path));
  }
  EFDL_RETURN_IF_ERROR(manifest->Validate().WithContext(path));
  return SnapshotFileInfo{std::move(manifest).value(), h.data_offset, h.data_checksum,
                          file.Size(), static_cast<int>(h.version)};
}

Status VerifySnapshotData(const RandomAccessFile& file, const SnapshotFileInfo& info,
                          const std::string& path, ParallelRunner* runner) {
  auto pieces = PiecesOf(info.manifest.tensors);
  std::vector<uint64_t> hashes(pieces.size());
  ScratchPool scratch(runner != nullptr ? static_cast<size_t>(runner->threads()) : 1,
                      kPieceBytes);
  EFDL_RETURN_IF_ERROR(ForEachPiece(pieces, runner, [&](size_t i) -> Status {
    const int b = scratch.Acquire();
    const Piece& p = pieces[i];
    Status s = file.Read(info.data_offset + p.offset, p.length, scratch.buffer(b));
    if (s.ok()) hashes[i] = PieceHash(info.format, scratch.buffer(b), p.length, p.Seed());
    scratch.Release(b);
    return s;
  }));
  if (FoldPieceHashes(hashes) != info.data_checksum) {
    return Status::Corruption(fmt::format("{} failed its data checksum", path));
  }
  return Status::OK();
}

Status ReadSnapshotTensors(const RandomAccessFile& file, const SnapshotFileInfo& info,
                           const std::vector<void*>& dst, ParallelRunner* runner) {
  const auto& tensors = info.manifest.tensors;
  if (dst.size() != tensors.size()) {
    return Status::InvalidArgument(fmt::format("restore got {} destinations for {} tensors",
                                               dst.size(), tensors.size()));
  }
  auto pieces = PiecesOf(tensors);
  return ForEachPiece(pieces, runner, [&](size_t i) -> Status {
    const Piece& p = pieces[i];
    void* base = dst[p.tensor];
    if (base == nullptr || p.length == 0) return Status::OK();
    auto* out = static_cast<uint8_t*>(base) + (p.offset - tensors[p.tensor].offset);
    return file.Read(info.data_offset + p.offset, p.length, out);
  });
}

}  // namespace efdl::snapshot
