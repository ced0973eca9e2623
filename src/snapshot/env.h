// The file-system operations the snapshot store uses, behind an interface (as in leveldb) so tests
// can inject faults: a crash between write and rename, short writes, a full disk.
//
// Env implementations are thread-safe; file objects are used by one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "efdl/status.h"

namespace efdl::snapshot {

class WritableFile {
 public:
  virtual ~WritableFile() = default;
  virtual Status Append(const void* data, size_t n) = 0;
  virtual Status Sync() = 0;   // data and metadata on stable storage (fsync)
  virtual Status Close() = 0;  // idempotent
};

class RandomAccessFile {
 public:
  virtual ~RandomAccessFile() = default;
  // Reads exactly n bytes at offset into dst; a short file is a Corruption.
  virtual Status Read(uint64_t offset, size_t n, void* dst) const = 0;
  virtual uint64_t Size() const = 0;
};

class Env {
 public:
  virtual ~Env() = default;
  // The POSIX implementation. Stateless, shared by everyone; never deleted.
  static Env* Posix();

  virtual Result<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path) = 0;
  virtual Result<std::unique_ptr<RandomAccessFile>> NewRandomAccessFile(
      const std::string& path) = 0;
  virtual Status RenameFile(const std::string& from, const std::string& to) = 0;
  virtual Status RemoveFile(const std::string& path) = 0;
  virtual Status CreateDirs(const std::string& path) = 0;  // mkdir -p
  virtual Result<std::vector<std::string>> GetChildren(const std::string& dir) = 0;  // names only
  virtual Status SyncDir(const std::string& dir) = 0;  // makes a rename in dir durable
  virtual bool FileExists(const std::string& path) = 0;
};

// A message for errno that says what to do for the common storage failures.
std::string DescribeStorageErrno(int err);

}  // namespace efdl::snapshot
