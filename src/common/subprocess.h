// Child processes with an owner: a Subprocess kills and reaps its child (its whole process group)
// when destroyed, unless the child was already reaped.
//
// Spawning uses fork + execve with only async-signal-safe calls in between, so it is safe in a
// process that runs gRPC threads. With die_with_parent the child gets SIGKILL when the *thread*
// that spawned it exits (Linux PR_SET_PDEATHSIG): spawn from a thread that lives as long as the
// child should.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "efdl/status.h"

namespace efdl {

class GroupReaper;

// One field per choice of a child's start (argv, environment, stdio, process group, inherited
// descriptors, reaper), flat on purpose: a plain value in posix_spawn's style.
struct SpawnOptions {
  enum class Stdio { kInherit, kPipe, kNull, kFile };
  std::vector<std::string> argv;                  // argv[0] is looked up in PATH
  std::map<std::string, std::string> env_set;     // added to (or replacing in) our environment
  std::vector<std::string> env_unset;
  bool clear_env = false;                         // start from an empty environment
  std::string cwd;                                // empty: ours
  Stdio stdout_mode = Stdio::kInherit;
  Stdio stderr_mode = Stdio::kInherit;
  bool stderr_to_stdout = false;                  // dup stderr onto stdout's destination
  std::string stdout_path;                        // kFile (appended)
  std::string stderr_path;                        // kFile (appended)
  bool new_process_group = true;                  // child leads its own group: signals reach all
  bool die_with_parent = true;
  // Descriptors of ours the child keeps under the same numbers (close-on-exec cleared in the
  // child only), e.g. a pipe end it is told about on its command line. Must not be 0-2.
  std::vector<int> inherit_fds;
  // Not owned, must outlive the Subprocess; with new_process_group: the child's group is listed
  // with it from the start until the Subprocess is destroyed, so that the group (the child and
  // whatever it started) is killed even when this process dies without doing it.
  GroupReaper* reaper = nullptr;
};

class Subprocess {
 public:
  // Starts the child. Fails (without leaving a child behind) when argv is empty, the program is
  // not found or not executable, or the working directory does not exist.
  static Result<Subprocess> Spawn(const SpawnOptions& options);

  // Takes ownership of `pid`: a child of this process that leads its own process group but was
  // not started by Spawn (a spare forked by the zygote and adopted by this process as a child
  // subreaper, agent/zygote.h), with its pipe ends (-1: none). Lists the group with `reaper`
  // (may be null) as Spawn does.
  static Subprocess Adopt(pid_t pid, int stdout_fd, int stderr_fd, GroupReaper* reaper);

  Subprocess() = default;
  Subprocess(Subprocess&& other) noexcept;
  Subprocess& operator=(Subprocess&& other) noexcept;
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;
  ~Subprocess();  // SIGKILLs the group and reaps, if still running

  pid_t pid() const { return pid_; }
  bool running() const { return pid_ > 0 && !exit_status_.has_value(); }
  // Pipe ends for kPipe streams (owned by this object; -1 otherwise).
  int stdout_fd() const { return stdout_fd_; }
  int stderr_fd() const { return stderr_fd_; }
  // Gives up ownership of a pipe end (the caller closes it).
  int ReleaseStdout();
  int ReleaseStderr();

  // Sends a signal to the child's process group (or the child alone without a group).
  Status Signal(int sig) const;
  // Non-blocking: the raw wait status once the child has exited.
  std::optional<int> Poll();
  // Waits up to `timeout`; nullopt if still running.
  std::optional<int> WaitFor(std::chrono::milliseconds timeout);
  int Wait();
  // SIGTERM, then SIGKILL after `grace`; always reaps. Returns the wait status.
  int Stop(std::chrono::milliseconds grace);
  std::optional<int> exit_status() const { return exit_status_; }

 private:
  void Reset();
  pid_t pid_ = -1;
  bool group_ = false;
  GroupReaper* reaper_ = nullptr;   // lists our group while set
  int stdout_fd_ = -1;
  int stderr_fd_ = -1;
  std::optional<int> exit_status_;
};

// What a pipe holds now, up to `limit` bytes, without blocking (sets O_NONBLOCK on `fd`); "" for
// fd < 0.
std::string ReadAvailable(int fd, size_t limit);

// The complete lines in what a child writes to a pipe, fed a chunk at a time (ReadAvailable). A
// line longer than `max_line` bytes comes out in pieces of that size: the buffer stays bounded
// even for output that never ends a line.
class PipeLines {
 public:
  explicit PipeLines(size_t max_line = 4096) : max_line_(max_line) {}
  std::vector<std::string> Feed(std::string_view bytes);
  // What came after the last newline; clears it.
  std::string TakeRest();

 private:
  size_t max_line_;
  std::string partial_;
};
// "exited with status 3", "killed by signal 9 (SIGKILL)".
std::string DescribeWaitStatus(int wait_status);
// True for a normal exit with status 0.
bool WaitStatusSuccess(int wait_status);
// Full path of `program` found in PATH (or itself if it contains '/'), NotFound otherwise.
Result<std::string> FindProgram(const std::string& program);

}  // namespace efdl
