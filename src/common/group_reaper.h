// Process groups that must not outlive their owner, even when the owner is SIGKILLed.
//
// A worker gets PR_SET_PDEATHSIG and dies with the agent, but the processes it started itself
// (a data loader, a helper it runs with subprocess) do not: they live on in the worker's process
// group, orphaned, holding memory, ports and GPUs. A GroupReaper is a small process forked from
// the owner that is told the groups to look after over a socket; when the owner's end closes -
// the owner exited, by any means - it SIGKILLs every group still listed and exits. The owner
// removes a group once it has killed the group itself, so an orderly exit kills nothing.
//
// It also removes directories it is told about (AddDirectory): the private etcd's data directory
// (efdl/embedded_etcd.h), which a SIGKILLed owner never removes. When the owner's end closes it
// first SIGKILLs the listed groups, waits (at most kDirectoryWait) until they are gone - so no
// process writes into a directory while it is removed - and then removes each listed directory
// with everything in it. An orderly owner removes the directory itself and unlists it.
//
// The reaper's process name is "efdl-reaper" (ps -o comm). It leads its own process group and ignores SIGINT, SIGTERM, SIGHUP and SIGQUIT, so a
// signal to the owner's group (Ctrl-C, a supervisor's kill of the group) does not take it along
// before it did its work. It keeps no descriptor of the owner's but its end of the socket.
//
// Threading: Add/Remove are thread-safe (one small write each). The destructor closes the
// socket and reaps the reaper process.
#pragma once

#include <sys/types.h>

#include <memory>
#include <mutex>
#include <string>

#include "common/thread_annotations.h"
#include "efdl/status.h"

namespace efdl {

class GroupReaper {
 public:
  // Forks the reaper. Safe in a process with threads (the child makes only async-signal-safe
  // calls).
  static Result<std::unique_ptr<GroupReaper>> Start();

  GroupReaper(const GroupReaper&) = delete;
  GroupReaper& operator=(const GroupReaper&) = delete;
  ~GroupReaper();

  // Lists / unlists process group `pgid` (> 1). Fails when the reaper is gone (it is then of no
  // use: the caller may go on without it).
  Status Add(pid_t pgid);
  Status Remove(pid_t pgid);
  // Lists / unlists a directory (an absolute path without newlines, < 4096 characters) to remove
  // recursively when the owner dies (symbolic links inside are removed, never followed).
  Status AddDirectory(const std::string& path);
  Status RemoveDirectory(const std::string& path);

  // How long a dying owner's reaper waits for the killed groups before removing directories.
  static constexpr int kDirectoryWaitMs = 3000;

  pid_t pid() const { return pid_; }

 private:
  GroupReaper(pid_t pid, int fd) : pid_(pid), fd_(fd) {}
  Status Send(char op, pid_t pgid);
  Status SendLine(const std::string& msg);

  const pid_t pid_;
  const int fd_;
  Mutex send_mu_;   // one message at a time on the socket
};

}  // namespace efdl
