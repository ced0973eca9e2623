// FaultEnv: the POSIX Env with injectable failures, for the persistence tests.
#pragma once

#include <atomic>
#include <cerrno>
#include <cstring>
#include <functional>

#include <fmt/format.h>

#include "snapshot/env.h"

namespace efdl::snapshot::testing {

class FaultEnv final : public Env {
 public:
  // Simulates a crash between writing the temporary and renaming it.
  std::atomic<bool> fail_rename{false};
  // Bytes the disk still takes; afterwards writes fail with ENOSPC. Negative: unlimited.
  std::atomic<int64_t> space_left{-1};
  // Called after each successful Append with the file's bytes so far (set it before the writes
  // start; e.g. to commit while a persister is in the middle of a file).
  std::function<void(uint64_t written)> after_append;

  Result<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path) override {
    auto inner = Env::Posix()->NewWritableFile(path);
    if (!inner.ok()) return inner.status();
    return std::unique_ptr<WritableFile>(new File(this, path, std::move(inner).value()));
  }
  Result<std::unique_ptr<RandomAccessFile>> NewRandomAccessFile(const std::string& p) override {
    return Env::Posix()->NewRandomAccessFile(p);
  }
  Status RenameFile(const std::string& from, const std::string& to) override {
    if (fail_rename) return Status::IOError("injected crash before rename of " + from);
    return Env::Posix()->RenameFile(from, to);
  }
  Status RemoveFile(const std::string& p) override { return Env::Posix()->RemoveFile(p); }
  Status CreateDirs(const std::string& p) override { return Env::Posix()->CreateDirs(p); }
  Result<std::vector<std::string>> GetChildren(const std::string& d) override {
    return Env::Posix()->GetChildren(d);
  }
  Status SyncDir(const std::string& d) override { return Env::Posix()->SyncDir(d); }
  bool FileExists(const std::string& p) override { return Env::Posix()->FileExists(p); }

 private:
  class File final : public WritableFile {
   public:
    File(FaultEnv* env, std::string path, std::unique_ptr<WritableFile> inner)
        : env_(env), path_(std::move(path)), inner_(std::move(inner)) {}
    Status Append(const void* data, size_t n) override {
      int64_t left = env_->space_left.load();
      if (left >= 0) {
        if (static_cast<int64_t>(n) > left) {
          env_->space_left = 0;
          (void)inner_->Append(data, static_cast<size_t>(left));  // a partial write, like a disk
          return Status::IOError(
              fmt::format("cannot write {}: {}", path_, DescribeStorageErrno(ENOSPC)));
        }
        env_->space_left -= static_cast<int64_t>(n);
      }
      Status s = inner_->Append(data, n);
      written_ += n;
      if (s.ok() && env_->after_append) env_->after_append(written_);
      return s;
    }
    Status Sync() override { return inner_->Sync(); }
    Status Close() override { return inner_->Close(); }

   private:
    FaultEnv* env_;
    std::string path_;
    std::unique_ptr<WritableFile> inner_;
    uint64_t written_ = 0;
  };
};

}  // namespace efdl::snapshot::testing
