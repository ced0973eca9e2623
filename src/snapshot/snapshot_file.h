// The on-storage snapshot file:
//
//   [0, 64)            FileHeader: magic "EFDLSNAP", version, lengths, manifest hash,
//                      data checksum, and a hash of the header itself
//   [64, 64+M)         manifest (JSON, see Manifest::Serialize)
//   [data_offset, +D)  data region, byte-identical to an arena slot's (data_offset is 4 KiB aligned)
//
// A file is only ever created under a temporary name and renamed into place after fsync, so a
// reader sees either a complete file or none; the hashes catch everything else (truncation, a
// torn copy on a shared mount, bit rot).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "efdl/snapshot.h"
#include "snapshot/env.h"
#include "snapshot/hash.h"
#include "snapshot/parallel.h"

namespace efdl::snapshot {

struct SnapshotFileInfo {
  Manifest manifest;
  uint64_t data_offset = 0;
  uint64_t data_checksum = 0;
  uint64_t file_bytes = 0;
  int format = kCurrentDataFormat;  // the header's version: which piece hash (hash.h)
};

// Writes header, manifest and the data region to `file` (no sync: the caller syncs).
// `after_chunk`, when given, is asked after each piece of data (8 MiB) is appended; a non-OK
// answer stops the write with it (the persister's check that its arena slot was not taken).
Status WriteSnapshotFile(WritableFile* file, const Manifest& manifest, const uint8_t* data,
                         uint64_t data_checksum,
                         const std::function<Status()>& after_chunk = {});
// Reads and checks header and manifest (not the data).
Result<SnapshotFileInfo> ReadSnapshotInfo(const RandomAccessFile& file, const std::string& path);
// Hashes the data region and compares with the header's checksum.
Status VerifySnapshotData(const RandomAccessFile& file, const SnapshotFileInfo& info,
                          const std::string& path, ParallelRunner* runner);
// Reads tensor i into dst[i] (nullptr: skip). Does not verify: call VerifySnapshotData first.
Status ReadSnapshotTensors(const RandomAccessFile& file, const SnapshotFileInfo& info,
                           const std::vector<void*>& dst, ParallelRunner* runner);

// Fixed buffers shared by the threads of one ParallelRunner::Run (one per thread suffices).
class ScratchPool {
 public:
  ScratchPool(size_t count, size_t bytes);
  int Acquire();  // spins until one is free (never long: count >= concurrent users)
  void Release(int i) { busy_[static_cast<size_t>(i)].store(false, std::memory_order_release); }
  uint8_t* buffer(int i) { return buffers_[static_cast<size_t>(i)].get(); }

 private:
  size_t bytes_;
  std::vector<std::unique_ptr<uint8_t[]>> buffers_;
  std::vector<std::atomic<bool>> busy_;
};

// The data checksum (current format) of a region laid out as `tensors` says (parallel over
// pieces).
uint64_t ChecksumOfRegion(const std::vector<TensorEntry>& tensors, const uint8_t* data,
                          ParallelRunner* runner);

}  // namespace efdl::snapshot
