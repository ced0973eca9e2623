#include "etcd/private_dirs.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "common/log.h"

namespace efdl::etcd {

namespace fs = std::filesystem;

namespace {

// etcd's database, which bbolt flocks (LOCK_EX) for as long as etcd runs.
constexpr const char* kDatabase = "member-data/member/snap/db";

bool DatabaseLocked(const std::string& dir) {
  int fd = ::open((dir + "/" + kDatabase).c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return false;
  bool locked = false;
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    locked = errno == EWOULDBLOCK;
  } else {
    ::flock(fd, LOCK_UN);   // a starting etcd retries its lock meanwhile (bbolt polls)
  }
  ::close(fd);
  return locked;
}

uint64_t AllocatedBytes(const std::string& dir) {
  uint64_t total = 0;
  std::error_code ec;
  for (fs::recursive_directory_iterator it(dir, fs::directory_options::skip_permission_denied, ec),
       end;
       !ec && it != end; it.increment(ec)) {
    struct stat st{};
    if (::lstat(it->path().c_str(), &st) == 0) total += static_cast<uint64_t>(st.st_blocks) * 512;
  }
  return total;
}

std::string ProcessName() {
  std::ifstream in("/proc/self/comm");
  std::string name;
  std::getline(in, name);
  return name.empty() ? "?" : name;
}

}  // namespace

std::string TempBase() {
  const char* base = std::getenv("TMPDIR");
  return base != nullptr && *base != '\0' ? base : "/tmp";
}

std::optional<uint64_t> ProcessStartTicks(pid_t pid) {
  if (pid <= 0) return std::nullopt;
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string stat;
  if (!std::getline(in, stat)) return std::nullopt;
  size_t paren = stat.rfind(')');
  if (paren == std::string::npos) return std::nullopt;
  std::istringstream fields(stat.substr(paren + 1));
  std::string field;
  // After "pid (comm)": state is field 3, starttime field 22.
  for (int i = 3; i <= 22; ++i) {
    if (!(fields >> field)) return std::nullopt;
    if (i == 3 && field == "Z") return std::nullopt;
  }
  try {
    return std::stoull(field);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

Status WriteOwnerFile(const std::string& dir) {
  auto start = ProcessStartTicks(::getpid());
  if (!start) return Status::IOError("cannot read this process's start time from /proc/self/stat");
  const std::string path = dir + "/" + kOwnerFile;
  const std::string tmp = path + ".new";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << fmt::format("pid {} start {} {}\n", ::getpid(), *start, ProcessName());
    if (!out.flush()) return Status::IOError(fmt::format("cannot write {}", tmp));
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) return Status::IOError(fmt::format("cannot write {}: {}", path, ec.message()));
  return Status::OK();
}

std::vector<PrivateEtcdDir> ScanPrivateEtcdDirs(const std::string& base,
                                                std::chrono::seconds young) {
  std::vector<PrivateEtcdDir> out;
  const std::string prefix = std::string(kPrivateDirPrefix) + "-";
  std::error_code ec;
  const auto now = fs::file_time_type::clock::now();
  for (fs::directory_iterator it(base, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!name.starts_with(prefix) || name.size() != prefix.size() + 6) continue;
    struct stat st{};
    if (::lstat(it->path().c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::geteuid()) {
      continue;   // not a directory (a symbolic link, say) or not ours
    }
    PrivateEtcdDir d;
    d.path = it->path().string();
    std::ifstream owner_in(d.path + "/" + kOwnerFile);
    std::getline(owner_in, d.owner);
    long long pid = 0;
    unsigned long long start = 0;
    char comm[64] = {};
    const bool has_owner =
        std::sscanf(d.owner.c_str(), "pid %lld start %llu %63s", &pid, &start, comm) >= 2 &&
        pid > 0;
    if (has_owner) {
      auto running = ProcessStartTicks(static_cast<pid_t>(pid));
      d.live = running && *running == start;
      d.why = d.live ? fmt::format("its owner, pid {}, runs", pid)
                     : fmt::format("its owner, pid {}, is gone", pid);
    } else {
      std::error_code age_ec;
      auto modified = fs::last_write_time(d.path, age_ec);
      d.live = age_ec || now - modified < young;
      d.why = d.live ? "no owner file yet (being set up)" : "no owner file";
    }
    if (!d.live && DatabaseLocked(d.path)) {
      d.live = true;
      d.why = "a running etcd holds its database";
    }
    d.bytes = AllocatedBytes(d.path);
    out.push_back(std::move(d));
  }
  std::sort(out.begin(), out.end(),
            [](const PrivateEtcdDir& a, const PrivateEtcdDir& b) { return a.path < b.path; });
  return out;
}

std::vector<PrivateEtcdDir> RemoveStalePrivateEtcdDirs(const std::string& base, bool dry_run,
                                                       std::chrono::seconds young) {
  std::vector<PrivateEtcdDir> removed;
  for (auto& d : ScanPrivateEtcdDirs(base, young)) {
    if (d.live) continue;
    if (!dry_run) {
      std::error_code ec;
      fs::remove_all(d.path, ec);
      if (ec) {
        EFDL_LOG_WARN("cannot remove the stale private etcd directory {}: {}", d.path,
                      ec.message());
        continue;
      }
      EFDL_LOG_INFO("removed {} ({:.0f} MiB), the private etcd directory of a command that died "
                    "({})", d.path, static_cast<double>(d.bytes) / (1 << 20), d.why);
    }
    removed.push_back(std::move(d));
  }
  return removed;
}

}  // namespace efdl::etcd
