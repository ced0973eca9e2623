#include "common/subprocess.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "common/group_reaper.h"
#include "common/log.h"

extern char** environ;

namespace efdl {

namespace {

void CloseFd(int& fd) {
  if (fd >= 0) {
    ::close(fd);
    fd = -1;
  }
}

bool IsExecutable(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
}

// Writes errno and a tag to the error pipe and exits; only async-signal-safe calls.
[[noreturn]] void ChildFail(int err_fd, int stage) {
  int payload[2] = {stage, errno};
  ssize_t ignored = ::write(err_fd, payload, sizeof(payload));
  (void)ignored;
  ::_exit(127);
}

}  // namespace

Result<std::string> FindProgram(const std::string& program) {
  if (program.empty()) return Status::InvalidArgument("empty program name");
  if (program.find('/') != std::string::npos) {
    if (IsExecutable(program)) return program;
    return Status::NotFound(fmt::format("'{}' does not exist or is not executable", program));
  }
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/local/bin:/usr/bin:/bin";
  size_t start = 0;
  while (start <= dirs.size()) {
    size_t end = dirs.find(':', start);
    if (end == std::string::npos) end = dirs.size();
    std::string dir = dirs.substr(start, end - start);
    if (dir.empty()) dir = ".";
    std::string candidate = dir + "/" + program;
    if (IsExecutable(candidate)) return candidate;
    start = end + 1;
  }
  return Status::NotFound(fmt::format("command '{}' not found in PATH", program));
}

Result<Subprocess> Subprocess::Spawn(const SpawnOptions& options) {
  if (options.argv.empty()) return Status::InvalidArgument("no command given");
  EFDL_ASSIGN_OR_RETURN(std::string exe, FindProgram(options.argv[0]));
  if (!options.cwd.empty()) {
    struct stat st {};
    if (::stat(options.cwd.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      return Status::InvalidArgument(
          fmt::format("working directory '{}' does not exist", options.cwd));
    }
  }

  // Build argv and envp before fork: the child may not allocate.
  std::vector<std::string> env_strings;
  std::map<std::string, std::string> env;
  if (!options.clear_env) {
    for (char** e = environ; e && *e; ++e) {
      std::string_view kv(*e);
      size_t eq = kv.find('=');
      if (eq == std::string_view::npos) continue;
      env[std::string(kv.substr(0, eq))] = std::string(kv.substr(eq + 1));
    }
  }
  for (const auto& k : options.env_unset) env.erase(k);
  for (const auto& [k, v] : options.env_set) env[k] = v;
  env_strings.reserve(env.size());
  for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_copy = options.argv;
  std::vector<char*> argv;
  for (auto& s : argv_copy) argv.push_back(s.data());
  argv.push_back(nullptr);

  auto open_dest = [](SpawnOptions::Stdio mode, const std::string& path, int pipe_fds[2],
                      int& child_fd) -> Status {
    switch (mode) {
      case SpawnOptions::Stdio::kInherit: child_fd = -1; return Status::OK();
      case SpawnOptions::Stdio::kNull:
        child_fd = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
        break;
      case SpawnOptions::Stdio::kFile:
        child_fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        if (child_fd < 0) {
          return Status::IOError(fmt::format("cannot open log file '{}': {}", path, std::strerror(errno)));
        }
        return Status::OK();
      case SpawnOptions::Stdio::kPipe:
        if (::pipe2(pipe_fds, O_CLOEXEC) != 0) {
          return Status::IOError(fmt::format("pipe: {}", std::strerror(errno)));
        }
        child_fd = pipe_fds[1];
        return Status::OK();
    }
    return Status::OK();
  };

  int out_pipe[2] = {-1, -1}, err_pipe[2] = {-1, -1};
  int child_out = -1, child_err = -1;
  auto cleanup = [&] {
    for (int* fd : {&out_pipe[0], &err_pipe[0]}) CloseFd(*fd);
    if (child_out >= 0) ::close(child_out);
    if (child_err >= 0 && child_err != child_out) ::close(child_err);
  };
  Status st = open_dest(options.stdout_mode, options.stdout_path, out_pipe, child_out);
  if (st.ok() && !options.stderr_to_stdout) {
    st = open_dest(options.stderr_mode, options.stderr_path, err_pipe, child_err);
  }
  if (!st.ok()) {
    cleanup();
    return st;
  }

  int status_pipe[2];
  if (::pipe2(status_pipe, O_CLOEXEC) != 0) {
    cleanup();
    return Status::IOError(fmt::format("pipe: {}", std::strerror(errno)));
  }
  pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid < 0) {
    int e = errno;
    cleanup();
    ::close(status_pipe[0]);
    ::close(status_pipe[1]);
    return Status::Internal(fmt::format("fork: {}", std::strerror(e)));
  }
  if (pid == 0) {
    // Child: async-signal-safe calls only.
    if (options.new_process_group && ::setpgid(0, 0) != 0) ChildFail(status_pipe[1], 1);
    if (options.die_with_parent) {
      if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) ChildFail(status_pipe[1], 2);
      if (::getppid() != parent) ::_exit(1);  // parent already gone
    }
    // Default signal dispositions and an empty mask, whatever the parent had.
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    for (int sig : {SIGINT, SIGTERM, SIGPIPE, SIGCHLD, SIGHUP, SIGQUIT}) ::signal(sig, SIG_DFL);
    if (child_out >= 0 && ::dup2(child_out, STDOUT_FILENO) < 0) ChildFail(status_pipe[1], 3);
    if (options.stderr_to_stdout) {
      if (::dup2(STDOUT_FILENO, STDERR_FILENO) < 0) ChildFail(status_pipe[1], 3);
    } else if (child_err >= 0 && ::dup2(child_err, STDERR_FILENO) < 0) {
      ChildFail(status_pipe[1], 3);
    }
    for (int fd : options.inherit_fds) {
      if (fd <= STDERR_FILENO || ::fcntl(fd, F_SETFD, 0) != 0) ChildFail(status_pipe[1], 6);
    }
    if (!options.cwd.empty() && ::chdir(options.cwd.c_str()) != 0) ChildFail(status_pipe[1], 4);
    ::execve(exe.c_str(), argv.data(), envp.data());
    ChildFail(status_pipe[1], 5);
  }

  // Parent.
  if (options.new_process_group) ::setpgid(pid, pid);  // close the race with the child's own call
  ::close(status_pipe[1]);
  if (child_out >= 0) ::close(child_out);
  if (child_err >= 0 && child_err != child_out) ::close(child_err);
  child_out = child_err = -1;
  int payload[2] = {0, 0};
  ssize_t n;
  do {
    n = ::read(status_pipe[0], payload, sizeof(payload));
  } while (n < 0 && errno == EINTR);
  ::close(status_pipe[0]);

  Subprocess proc;
  proc.pid_ = pid;
  proc.group_ = options.new_process_group;
  proc.stdout_fd_ = out_pipe[0];
  proc.stderr_fd_ = err_pipe[0];
  if (n > 0) {
    proc.Wait();
    static constexpr const char* kStages[] = {"", "setpgid", "prctl", "redirecting output",
                                              "chdir", "exec", "keeping a descriptor"};
    int stage = payload[0] >= 1 && payload[0] <= 6 ? payload[0] : 5;
    return Status::Internal(fmt::format("cannot start '{}': {} failed: {}", options.argv[0],
                                        kStages[stage], std::strerror(payload[1])));
  }
  if (options.reaper != nullptr && proc.group_) {
    if (Status listed = options.reaper->Add(pid); listed.ok()) {
      proc.reaper_ = options.reaper;
    } else {
      EFDL_LOG_WARN("process group {} ({}) would outlive an abrupt exit of this process: {}",
                    pid, options.argv[0], listed.message());
    }
  }
  return proc;
}

std::string ReadAvailable(int fd, size_t limit) {
  std::string out;
  if (fd < 0) return out;
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  char buf[4096];
  while (out.size() < limit) {
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

std::vector<std::string> PipeLines::Feed(std::string_view bytes) {
  partial_ += bytes;
  std::vector<std::string> lines;
  size_t start = 0;
  for (size_t nl; (nl = partial_.find('\n', start)) != std::string::npos; start = nl + 1) {
    lines.push_back(partial_.substr(start, nl - start));
  }
  partial_.erase(0, start);
  while (partial_.size() > max_line_) {
    lines.push_back(partial_.substr(0, max_line_));
    partial_.erase(0, max_line_);
  }
  return lines;
}

std::string PipeLines::TakeRest() {
  std::string rest;
  rest.swap(partial_);
  return rest;
}

Subprocess Subprocess::Adopt(pid_t pid, int stdout_fd, int stderr_fd, GroupReaper* reaper) {
  Subprocess proc;
  proc.pid_ = pid;
  proc.group_ = true;
  proc.stdout_fd_ = stdout_fd;
  proc.stderr_fd_ = stderr_fd;
  if (reaper != nullptr) {
    if (Status listed = reaper->Add(pid); listed.ok()) {
      proc.reaper_ = reaper;
    } else {
      EFDL_LOG_WARN("process group {} would outlive an abrupt exit of this process: {}", pid,
                    listed.message());
    }
  }
  return proc;
}

Subprocess::Subprocess(Subprocess&& other) noexcept { *this = std::move(other); }

Subprocess& Subprocess::operator=(Subprocess&& other) noexcept {
  if (this != &other) {
    Reset();
    pid_ = std::exchange(other.pid_, -1);
    group_ = other.group_;
    reaper_ = std::exchange(other.reaper_, nullptr);
    stdout_fd_ = std::exchange(other.stdout_fd_, -1);
    stderr_fd_ = std::exchange(other.stderr_fd_, -1);
    exit_status_ = std::exchange(other.exit_status_, std::nullopt);
  }
  return *this;
}

Subprocess::~Subprocess() { Reset(); }

void Subprocess::Reset() {
  if (running()) {
    if (group_) ::kill(-pid_, SIGKILL);
    ::kill(pid_, SIGKILL);
    Wait();
  }
  if (reaper_ != nullptr && pid_ > 0) (void)reaper_->Remove(pid_);
  reaper_ = nullptr;
  CloseFd(stdout_fd_);
  CloseFd(stderr_fd_);
  pid_ = -1;
  exit_status_.reset();
}

int Subprocess::ReleaseStdout() { return std::exchange(stdout_fd_, -1); }
int Subprocess::ReleaseStderr() { return std::exchange(stderr_fd_, -1); }

Status Subprocess::Signal(int sig) const {
  if (pid_ <= 0) return Status::FailedPrecondition("no child process");
  if (exit_status_.has_value() && !group_) return Status::OK();
  // The group may outlive its leader (grandchildren): signal it even after the leader exited.
  int rc = group_ ? ::kill(-pid_, sig) : ::kill(pid_, sig);
  if (rc != 0 && errno != ESRCH) {
    return Status::Internal(fmt::format("kill({}, {}): {}", pid_, sig, std::strerror(errno)));
  }
  return Status::OK();
}

std::optional<int> Subprocess::Poll() {
  if (exit_status_ || pid_ <= 0) return exit_status_;
  int status = 0;
  pid_t r;
  do {
    r = ::waitpid(pid_, &status, WNOHANG);
  } while (r < 0 && errno == EINTR);
  if (r == pid_) exit_status_ = status;
  return exit_status_;
}

std::optional<int> Subprocess::WaitFor(std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  auto step = std::chrono::milliseconds(1);
  while (true) {
    if (auto s = Poll()) return s;
    if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(step);
    step = std::min(step * 2, std::chrono::milliseconds(20));
  }
}

int Subprocess::Wait() {
  if (exit_status_) return *exit_status_;
  int status = 0;
  pid_t r;
  do {
    r = ::waitpid(pid_, &status, 0);
  } while (r < 0 && errno == EINTR);
  exit_status_ = r == pid_ ? status : 0;
  return *exit_status_;
}

int Subprocess::Stop(std::chrono::milliseconds grace) {
  if (!running()) {
    if (group_ && pid_ > 0) ::kill(-pid_, SIGKILL);  // stragglers in the group
    return exit_status_.value_or(0);
  }
  (void)Signal(SIGTERM);
  if (auto s = WaitFor(grace)) {
    if (group_) ::kill(-pid_, SIGKILL);
    return *s;
  }
  (void)Signal(SIGKILL);
  return Wait();
}

std::string DescribeWaitStatus(int wait_status) {
  if (WIFEXITED(wait_status)) return fmt::format("exited with status {}", WEXITSTATUS(wait_status));
  if (WIFSIGNALED(wait_status)) {
    int sig = WTERMSIG(wait_status);
    const char* abbrev = sigabbrev_np(sig);
    return fmt::format("killed by signal {} (SIG{})", sig, abbrev ? abbrev : "?");
  }
  return fmt::format("ended with wait status {}", wait_status);
}

bool WaitStatusSuccess(int wait_status) {
  return WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0;
}

}  // namespace efdl
