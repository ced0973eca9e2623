#include "common/group_reaper.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <ctime>
#include <cstring>

#include <fmt/format.h>

namespace efdl {

namespace {

constexpr int kMaxGroups = 4096;
constexpr int kMaxDirs = 8;
constexpr size_t kMaxLine = 4096;   // "+<pgid>", "-<pgid>", "D<path>" or "d<path>"
constexpr int kMaxDepth = 16;

bool SameString(const char* a, const char* b) {
  while (*a != '\0' && *a == *b) {
    ++a;
    ++b;
  }
  return *a == *b;
}

void CopyString(char* to, const char* from, size_t size) {
  size_t i = 0;
  for (; i + 1 < size && from[i] != '\0'; ++i) to[i] = from[i];
  to[i] = '\0';
}

int64_t MonotonicMs() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000 + ts.tv_nsec / 1000000;
}

// Whether nothing of group `pgid` runs any more: no member, or only its leader as a zombie (a
// killed process whose new parent has not reaped it yet).
bool GroupGone(pid_t pgid) {
  if (::kill(-pgid, 0) != 0 && errno == ESRCH) return true;
  char path[32] = "/proc/";
  char digits[16];
  int n = 0;
  for (auto v = static_cast<unsigned>(pgid); v > 0 && n < 15; v /= 10) digits[n++] = static_cast<char>('0' + v % 10);
  size_t len = 6;
  while (n > 0) path[len++] = digits[--n];
  CopyString(path + len, "/stat", sizeof(path) - len);
  int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return true;
  char buf[512];
  ssize_t got = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (got <= 0) return true;
  ssize_t paren = got - 1;   // "pid (comm) S ...": the state follows the last ')'
  while (paren >= 0 && buf[paren] != ')') --paren;
  return paren >= 0 && paren + 2 < got && buf[paren + 2] == 'Z';
}

// Removes what the directory open as `dir_fd` holds, `depth` levels of subdirectories at most.
// Symbolic links are removed, never followed (O_NOFOLLOW).
void RemoveContents(int dir_fd, int depth) {
  alignas(8) char buf[2048];
  bool removed_any = true;
  while (removed_any) {   // entries removed while reading: read again until a pass removes none
    removed_any = false;
    if (::lseek(dir_fd, 0, SEEK_SET) < 0) return;
    while (true) {
      long got = ::syscall(SYS_getdents64, dir_fd, buf, sizeof(buf));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) break;
      for (long off = 0; off < got;) {
        const auto* entry = reinterpret_cast<const struct dirent64*>(buf + off);
        off += entry->d_reclen;
        const char* name = entry->d_name;
        if (SameString(name, ".") || SameString(name, "..")) continue;
        if (::unlinkat(dir_fd, name, 0) == 0) {
          removed_any = true;
          continue;
        }
        if (errno != EISDIR || depth <= 0) continue;
        int sub = ::openat(dir_fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (sub >= 0) {
          RemoveContents(sub, depth - 1);
          ::close(sub);
        }
        if (::unlinkat(dir_fd, name, AT_REMOVEDIR) == 0) removed_any = true;
      }
    }
  }
}

void RemoveTree(const char* path) {
  int fd = ::open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return;
  RemoveContents(fd, kMaxDepth);
  ::close(fd);
  ::rmdir(path);
}

// The reaper process: async-signal-safe calls only (it was forked from a process with threads).
// Reads "+<pgid>\n" / "-<pgid>\n" / "D<path>\n" / "d<path>\n" until the owner's end closes,
// then SIGKILLs what is listed and removes the listed directories once those groups are gone.
[[noreturn]] void ReaperMain(int fd) {
  pid_t groups[kMaxGroups];
  int count = 0;
  char dirs[kMaxDirs][kMaxLine];
  int dir_count = 0;
  char line[kMaxLine];
  size_t len = 0;
  bool overlong = false;
  char buf[512];
  while (true) {
    ssize_t got = ::read(fd, buf, sizeof(buf));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    for (ssize_t i = 0; i < got; ++i) {
      if (buf[i] != '\n') {
        if (len + 1 < sizeof(line)) {
          line[len++] = buf[i];
        } else {
          overlong = true;
        }
        continue;
      }
      line[len] = '\0';
      if (!overlong && len >= 2 && line[1] == '/' && (line[0] == 'D' || line[0] == 'd')) {
        if (line[0] == 'D') {
          if (dir_count < kMaxDirs) CopyString(dirs[dir_count++], line + 1, kMaxLine);
        } else {
          for (int k = 0; k < dir_count; ++k) {
            if (SameString(dirs[k], line + 1)) {
              if (k != dir_count - 1) CopyString(dirs[k], dirs[dir_count - 1], kMaxLine);
              --dir_count;
              break;
            }
          }
        }
        len = 0;
        continue;
      }
      long value = 0;
      bool ok = !overlong && len >= 2 && (line[0] == '+' || line[0] == '-');
      for (size_t k = 1; ok && k < len; ++k) {
        ok = line[k] >= '0' && line[k] <= '9' && value < 100000000;
        value = value * 10 + (line[k] - '0');
      }
      if (ok && value > 1) {
        auto pgid = static_cast<pid_t>(value);
        if (line[0] == '+') {
          if (count < kMaxGroups) groups[count++] = pgid;
        } else {
          for (int k = 0; k < count; ++k) {
            if (groups[k] == pgid) {
              groups[k] = groups[--count];
              break;
            }
          }
        }
      }
      len = 0;
      overlong = false;
    }
  }
  for (int k = 0; k < count; ++k) ::kill(-groups[k], SIGKILL);
  if (dir_count > 0) {
    const int64_t deadline = MonotonicMs() + GroupReaper::kDirectoryWaitMs;
    for (int k = 0; k < count; ++k) {
      while (!GroupGone(groups[k]) && MonotonicMs() < deadline) {
        timespec tick{0, 10 * 1000 * 1000};
        ::nanosleep(&tick, nullptr);
      }
    }
    for (int k = 0; k < dir_count; ++k) RemoveTree(dirs[k]);
  }
  ::_exit(0);
}

}  // namespace

Result<std::unique_ptr<GroupReaper>> GroupReaper::Start() {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    return Status::IOError(fmt::format("group reaper: socketpair: {}", std::strerror(errno)));
  }
  pid_t pid = ::fork();
  if (pid < 0) {
    int e = errno;
    ::close(sv[0]);
    ::close(sv[1]);
    return Status::Internal(fmt::format("group reaper: fork: {}", std::strerror(e)));
  }
  if (pid == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_NAME, "efdl-reaper");   // what ps and top show for it
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE}) ::signal(sig, SIG_IGN);
    if (sv[1] != 3 && ::dup2(sv[1], 3) < 0) ::_exit(1);
    int null_fd = ::open("/dev/null", O_RDWR | O_CLOEXEC);
    for (int std_fd = 0; null_fd >= 0 && std_fd <= 2; ++std_fd) ::dup2(null_fd, std_fd);
    ::close_range(4, ~0U, 0);   // nothing of the owner's (locks, sockets, pipes) is kept
    ReaperMain(3);
  }
  ::close(sv[1]);
  return std::unique_ptr<GroupReaper>(new GroupReaper(pid, sv[0]));
}

GroupReaper::~GroupReaper() {
  ::close(fd_);   // the reaper kills what is still listed (nothing, after an orderly exit)
  int status = 0;
  while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
}

Status GroupReaper::Add(pid_t pgid) { return Send('+', pgid); }
Status GroupReaper::Remove(pid_t pgid) { return Send('-', pgid); }

Status GroupReaper::AddDirectory(const std::string& path) {
  if (path.empty() || path[0] != '/' || path.find('\n') != std::string::npos ||
      path.size() + 2 >= kMaxLine) {
    return Status::InvalidArgument(fmt::format("not a directory the reaper can list: '{}'", path));
  }
  return SendLine("D" + path + "\n");
}

Status GroupReaper::RemoveDirectory(const std::string& path) {
  if (path.empty() || path[0] != '/' || path.find('\n') != std::string::npos ||
      path.size() + 2 >= kMaxLine) {
    return Status::InvalidArgument(fmt::format("not a directory the reaper can list: '{}'", path));
  }
  return SendLine("d" + path + "\n");
}

Status GroupReaper::Send(char op, pid_t pgid) {
  if (pgid <= 1) return Status::InvalidArgument(fmt::format("not a process group: {}", pgid));
  return SendLine(fmt::format("{}{}\n", op, pgid));
}

Status GroupReaper::SendLine(const std::string& msg) {
  MutexLock lock(send_mu_);
  size_t off = 0;
  while (off < msg.size()) {
    ssize_t n = ::send(fd_, msg.data() + off, msg.size() - off, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return Status::Unavailable(fmt::format("the group reaper (pid {}) is gone: {}", pid_,
                                             std::strerror(errno)));
    }
    off += static_cast<size_t>(n);
  }
  return Status::OK();
}

}  // namespace efdl
