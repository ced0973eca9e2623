#include "agent/stale_dirs.h"

#include <errno.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "agent/zygote.h"
#include "health/progress_board.h"
#include "common/log.h"

namespace efdl::agent {

namespace {

// True only when connecting is refused and the socket file is at least `min_age` old: a
// socket whose listener is gone, not one whose agent has bound it and not yet listened.
bool DeadSocket(const std::string& path, std::chrono::seconds min_age) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0 || std::time(nullptr) - st.st_mtime < min_age.count()) {
    return false;
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) return false;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  int err = errno;
  ::close(fd);
  return rc != 0 && err == ECONNREFUSED;
}

// The inode of this process' pid namespace (0 when unknown): a pid means the same process only
// within one namespace.
uint64_t PidNamespace() {
  struct stat st {};
  if (::stat("/proc/self/ns/pid", &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_ino);
}

enum class Owner { kUnknown, kAlive, kGone };

// What `dir`'s owner file says: unknown without one (an older agent's directory, or one not yet
// written) or when it names another pid namespace.
Owner OwnerOf(const std::string& dir) {
  std::ifstream in(dir + "/" + kAgentOwnerFile);
  long long pid = 0;
  unsigned long long ns = 0;
  if (!(in >> pid >> ns) || pid <= 0 || ns == 0 || ns != PidNamespace()) return Owner::kUnknown;
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return Owner::kGone;
  return Owner::kAlive;   // or a later process with its pid: kept, the safe mistake
}

}  // namespace

Status WriteAgentOwnerFile(const std::string& dir) {
  const std::string path = dir + "/" + kAgentOwnerFile;
  std::ofstream out(path, std::ios::trunc);
  out << ::getpid() << " " << PidNamespace() << "\n";
  out.close();
  if (!out) return Status::IOError(fmt::format("cannot write {}", path));
  return Status::OK();
}

int RemoveStaleAgentDirs(const std::string& base, std::chrono::seconds empty_age,
                         std::chrono::seconds refused_age) {
  namespace fs = std::filesystem;
  int removed = 0;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(base, ec)) {
    const std::string name = entry.path().filename().string();
    if (!name.starts_with("efdl-agent-")) continue;
    struct stat st {};
    if (::lstat(entry.path().c_str(), &st) != 0 || !S_ISDIR(st.st_mode) ||
        st.st_uid != ::geteuid()) {
      continue;
    }
    int others = 0;
    bool has_socket = false;
    std::error_code list_ec;
    for (const auto& inner : fs::directory_iterator(entry.path(), list_ec)) {
      const std::string file = inner.path().filename().string();
      if (file == "control.sock") {
        has_socket = true;
      } else if (file != kAgentOwnerFile && !IsImportReportName(file, /*or_partial=*/true) &&
                 !health::IsHealthFileName(file)) {
        ++others;   // the agent's own files: owner, socket, import reports, board, stacks
      }
    }
    if (list_ec || others > 0) continue;
    const std::string sock = (entry.path() / "control.sock").string();
    const Owner owner = OwnerOf(entry.path().string());
    const bool stale = owner == Owner::kGone ||
                       (owner == Owner::kUnknown &&
                        (has_socket ? DeadSocket(sock, refused_age)
                                    : std::time(nullptr) - st.st_mtime >= empty_age.count()));
    if (!stale) continue;
    std::error_code rm;
    fs::remove_all(entry.path(), rm);
    if (rm) {
      EFDL_LOG_DEBUG("cannot remove stale agent directory {}: {}", entry.path().string(),
                     rm.message());
      continue;
    }
    EFDL_LOG_DEBUG("removed {}, left by an agent that was killed", entry.path().string());
    ++removed;
  }
  return removed;
}

}  // namespace efdl::agent
