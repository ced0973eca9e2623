#include "common/group_reaper.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

namespace efdl {

namespace {

constexpr int kMaxGroups = 4096;

// The reaper process: async-signal-safe calls only (it was forked from a process with threads).
// Reads "+<pgid>\n" / "-<pgid>\n" until the owner's end closes, then SIGKILLs what is listed.
[[noreturn]] void ReaperMain(int fd) {
  pid_t groups[kMaxGroups];
  int count = 0;
  char line[24];
  size_t len = 0;
  bool overlong = false;
  char buf[512];
  while (true) {
    ssize_t got = ::read(fd, buf, sizeof(buf));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    for (ssize_t i = 0; i < got; ++i) {
      if (buf[i] != '\n') {
        if (len < sizeof(line)) {
          line[len++] = buf[i];
        } else {
          overlong = true;
        }
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

Status GroupReaper::Send(char op, pid_t pgid) {
  if (pgid <= 1) return Status::InvalidArgument(fmt::format("not a process group: {}", pgid));
  std::string msg = fmt::format("{}{}\n", op, pgid);
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
