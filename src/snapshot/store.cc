#include "snapshot/store.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>

#include <fmt/format.h>

#include "common/log.h"
#include "common/net.h"
#include "snapshot/hmac.h"

namespace efdl::snapshot {

namespace {

constexpr std::string_view kPrefix = "snap-";
constexpr std::string_view kSuffix = ".efdl";

bool ParseSeq(std::string_view name, uint64_t* seq) {
  if (!name.starts_with(kPrefix) || !name.ends_with(kSuffix)) return false;
  std::string_view digits = name.substr(kPrefix.size(), name.size() - kPrefix.size() -
                                                            kSuffix.size());
  if (digits.empty()) return false;
  auto [ptr, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), *seq);
  return ec == std::errc() && ptr == digits.data() + digits.size();
}

}  // namespace

SnapshotStore::SnapshotStore(Env* env, std::string dir, int keep, std::string hmac_key)
    : env_(env != nullptr ? env : Env::Posix()),
      dir_(std::move(dir)),
      keep_(std::max(1, keep)),
      hmac_key_(std::move(hmac_key)) {}

std::string SnapshotStore::FileName(uint64_t seq) {
  return fmt::format("{}{:016d}{}", kPrefix, seq, kSuffix);
}

void SnapshotStore::RemoveStaleTemporaries() {
  auto names = env_->GetChildren(dir_);
  if (!names.ok()) return;
  const std::string mine = fmt::format(".tmp-{}-", HostName());
  for (const auto& name : *names) {
    if (!name.starts_with(mine)) continue;
    int pid = 0;
    std::string_view rest = std::string_view(name).substr(mine.size());
    auto [ptr, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), pid);
    if (ec != std::errc() || pid <= 0) continue;
    if (pid == ::getpid()) continue;
    if (::kill(pid, 0) == 0 || errno != ESRCH) continue;
    (void)env_->RemoveFile(dir_ + "/" + name);
  }
}

Status SnapshotStore::Write(const Manifest& manifest, const uint8_t* data,
                            uint64_t data_checksum,
                            const std::function<Status(const Manifest&)>& before_publish,
                            const std::function<Status(bool)>& source_check) {
  if (dir_made_ && !env_->FileExists(dir_)) {
    // Someone removed the job's directory while it ran: say so, then store there again.
    EFDL_LOG_WARN("snapshot: the job's snapshot directory {} disappeared while the job ran, "
                  "with every snapshot stored in it; creating it again for the next ones",
                  dir_);
  }
  EFDL_RETURN_IF_ERROR(env_->CreateDirs(dir_));
  dir_made_ = true;
  RemoveStaleTemporaries();
  const std::string tmp =
      fmt::format("{}/.tmp-{}-{}-{}{}", dir_, HostName(), ::getpid(), manifest.seq, kSuffix);
  const std::string final_path = dir_ + "/" + FileName(manifest.seq);
  Manifest signed_manifest;
  const Manifest* to_write = &manifest;
  if (!hmac_key_.empty()) {
    signed_manifest = manifest;
    EFDL_ASSIGN_OR_RETURN(signed_manifest.hmac, ComputeSnapshotHmac(hmac_key_, manifest, data));
    to_write = &signed_manifest;
  }
  auto file = env_->NewWritableFile(tmp);
  if (!file.ok()) return file.status();
  std::function<Status()> after_chunk;
  if (source_check) after_chunk = [&source_check] { return source_check(false); };
  Status s = WriteSnapshotFile(file->get(), *to_write, data, data_checksum, after_chunk);
  if (s.ok() && source_check) s = source_check(true);  // the data is in the file: source free
  if (s.ok()) s = (*file)->Sync();
  Status c = (*file)->Close();
  if (s.ok()) s = c;
  if (s.ok() && before_publish) {
    s = before_publish(manifest).WithContext(
        fmt::format("not publishing snapshot seq {}", manifest.seq));
  }
  if (s.ok()) s = env_->RenameFile(tmp, final_path);
  if (!s.ok()) {
    (void)env_->RemoveFile(tmp);
    return s;
  }
  EFDL_RETURN_IF_ERROR(env_->SyncDir(dir_));
  auto pruned = Prune(keep_);
  if (!pruned.ok()) EFDL_LOG_WARN("snapshot: {}", pruned.status().ToString());
  return Status::OK();
}

std::vector<SnapshotStore::Entry> SnapshotStore::List() const {
  std::vector<Entry> out;
  auto names = env_->GetChildren(dir_);
  if (!names.ok()) return out;
  for (const auto& name : *names) {
    uint64_t seq = 0;
    if (ParseSeq(name, &seq)) out.push_back({seq, dir_ + "/" + name});
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.seq > b.seq; });
  return out;
}

Result<SnapshotFileInfo> SnapshotStore::ReadInfo(const std::string& path) const {
  auto file = env_->NewRandomAccessFile(path);
  if (!file.ok()) return file.status();
  return ReadSnapshotInfo(**file, path);
}

Status SnapshotStore::Verify(const std::string& path, ParallelRunner* runner) const {
  auto file = env_->NewRandomAccessFile(path);
  if (!file.ok()) return file.status();
  auto info = ReadSnapshotInfo(**file, path);
  if (!info.ok()) return info.status();
  return VerifySnapshotData(**file, *info, path, runner);
}

Result<int> SnapshotStore::Prune(int keep) {
  auto entries = List();
  int removed = 0;
  for (size_t i = static_cast<size_t>(std::max(keep, 1)); i < entries.size(); ++i) {
    EFDL_RETURN_IF_ERROR(env_->RemoveFile(entries[i].path));
    ++removed;
  }
  return removed;
}

}  // namespace efdl::snapshot
