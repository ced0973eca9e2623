#include "agent/stale_dirs.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "common/net.h"

namespace efdl::agent {
namespace {

namespace fs = std::filesystem;

// A unix socket bound at `path`; listening unless `close_it` (then only the file remains, as
// after a SIGKILLed agent, and it is dated a minute back: the agent died a while ago). Returns
// the fd (-1 when closed).
int BoundSocket(const std::string& path, bool close_it) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  EXPECT_EQ(::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
  EXPECT_EQ(::listen(fd, 4), 0);
  if (close_it) {
    ::close(fd);
    fs::last_write_time(path, fs::file_time_type::clock::now() - std::chrono::minutes(1));
    return -1;
  }
  return fd;
}

TEST(RemoveStaleAgentDirs, RemovesOnlyDirectoriesOfDeadAgents) {
  auto tmp = TempDir::Create("efdl-stale-test");
  ASSERT_TRUE(tmp.ok());
  const fs::path base = tmp->path();
  for (const char* d : {"efdl-agent-dead01", "efdl-agent-dead02", "efdl-agent-live01",
                        "efdl-agent-other1", "efdl-agent-empty1", "efdl-agent-empty2",
                        "unrelated-dir"}) {
    fs::create_directory(base / d);
  }
  BoundSocket(base / "efdl-agent-dead01" / "control.sock", /*close_it=*/true);
  // A dead agent whose workers reported their imports (a report written, one half written)
  // after its last read: those files are the agent's own too.
  BoundSocket(base / "efdl-agent-dead02" / "control.sock", /*close_it=*/true);
  std::ofstream(base / "efdl-agent-dead02" / "imports-41-7.json") << "[\"numpy\"]\n";
  std::ofstream(base / "efdl-agent-dead02" / "imports-42-9.json.tmp") << "[\"nu";
  // ... and its hang detection's progress board and a worker's stack dump (issue #32).
  std::ofstream(base / "efdl-agent-dead02" / "progress.board") << "board";
  std::ofstream(base / "efdl-agent-dead02" / "stack-4242.txt") << "Thread 0x1\n";
  int live = BoundSocket(base / "efdl-agent-live01" / "control.sock", /*close_it=*/false);
  std::ofstream(base / "efdl-agent-live01" / "imports-43-1.json") << "[]\n";
  BoundSocket(base / "efdl-agent-other1" / "control.sock", /*close_it=*/true);
  std::ofstream(base / "efdl-agent-other1" / "keep.txt") << "not ours to delete\n";
  std::ofstream(base / "efdl-agent-other1" / "stack-notapid.txt") << "neither\n";
  BoundSocket(base / "unrelated-dir" / "control.sock", /*close_it=*/true);
  // An empty directory from long ago vs one an agent may have just made.
  fs::last_write_time(base / "efdl-agent-empty1",
                      fs::file_time_type::clock::now() - std::chrono::minutes(5));

  EXPECT_EQ(RemoveStaleAgentDirs(base.string()), 3);
  EXPECT_FALSE(fs::exists(base / "efdl-agent-dead01"));
  EXPECT_FALSE(fs::exists(base / "efdl-agent-dead02"));
  EXPECT_FALSE(fs::exists(base / "efdl-agent-empty1"));
  EXPECT_TRUE(fs::exists(base / "efdl-agent-live01" / "control.sock"));
  EXPECT_TRUE(fs::exists(base / "efdl-agent-live01" / "imports-43-1.json"));
  EXPECT_TRUE(fs::exists(base / "efdl-agent-other1" / "keep.txt"));
  EXPECT_TRUE(fs::exists(base / "efdl-agent-empty2"));
  EXPECT_TRUE(fs::exists(base / "unrelated-dir" / "control.sock"));
  ::close(live);
  // Its agent is gone now, but the socket file is fresh: kept until it is 10 s old.
  EXPECT_EQ(RemoveStaleAgentDirs(base.string()), 0);
  EXPECT_TRUE(fs::exists(base / "efdl-agent-live01" / "control.sock"));
  EXPECT_EQ(RemoveStaleAgentDirs(base.string(), std::chrono::seconds(60), std::chrono::seconds(0)),
            1);
  EXPECT_FALSE(fs::exists(base / "efdl-agent-live01"));
}

// A live agent's socket refuses connections between its bind() and its listen(): an agent
// starting beside it at that moment must leave its directory alone (it did not: a fault case
// lost node-a's progress board and control socket to its sibling's start).
TEST(RemoveStaleAgentDirs, KeepsTheDirectoryOfAnAgentBetweenBindAndListen) {
  auto tmp = TempDir::Create("efdl-stale-test");
  ASSERT_TRUE(tmp.ok());
  const fs::path dir = fs::path(tmp->path()) / "efdl-agent-start1";
  fs::create_directory(dir);
  std::ofstream(dir / "progress.board") << "board";
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string sock = (dir / "control.sock").string();
  std::memcpy(addr.sun_path, sock.c_str(), sock.size() + 1);
  ASSERT_EQ(::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);

  EXPECT_EQ(RemoveStaleAgentDirs(tmp->path()), 0);
  EXPECT_TRUE(fs::exists(dir / "progress.board"));
  EXPECT_EQ(::listen(fd, 4), 0);
  ::close(fd);
}

// A process of this pid namespace that has exited and been reaped: its pid names nobody.
pid_t GonePid() {
  pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return pid;
}

// The agent's directory as a Slurm task epilog finds it right after SIGKILLing the agent: its
// socket file is fresh, but its owner file names a process that is gone.
TEST(RemoveStaleAgentDirs, RemovesAtOnceTheDirectoryWhoseOwnerIsGone) {
  auto tmp = TempDir::Create("efdl-stale-test");
  ASSERT_TRUE(tmp.ok());
  const fs::path base = tmp->path();
  const fs::path dead = base / "efdl-agent-killed";
  const fs::path live = base / "efdl-agent-alive1";
  for (const auto& dir : {dead, live}) {
    fs::create_directory(dir);
    ASSERT_TRUE(WriteAgentOwnerFile(dir.string()).ok());
    BoundSocket(dir / "control.sock", /*close_it=*/true);
    fs::last_write_time(dir / "control.sock", fs::file_time_type::clock::now());
    std::ofstream(dir / "progress.board") << "board";
  }
  // This process owns `live` (alive); `dead`'s owner is rewritten to a reaped child's pid in the
  // same namespace.
  std::string line;
  std::getline(std::ifstream(dead / kAgentOwnerFile), line);
  const std::string ns = line.substr(line.find(' ') + 1);
  std::ofstream(dead / kAgentOwnerFile, std::ios::trunc) << GonePid() << " " << ns << "\n";

  EXPECT_EQ(RemoveStaleAgentDirs(base.string()), 1);
  EXPECT_FALSE(fs::exists(dead));
  // A live owner keeps its directory even with an old socket that refuses.
  EXPECT_EQ(RemoveStaleAgentDirs(base.string(), std::chrono::seconds(0), std::chrono::seconds(0)),
            0);
  EXPECT_TRUE(fs::exists(live / "control.sock"));
  // An owner file of another pid namespace says nothing: the socket's age decides.
  std::ofstream(live / kAgentOwnerFile, std::ios::trunc) << GonePid() << " 1\n";
  EXPECT_EQ(RemoveStaleAgentDirs(base.string()), 0);
  EXPECT_EQ(RemoveStaleAgentDirs(base.string(), std::chrono::seconds(60), std::chrono::seconds(0)),
            1);
}

}  // namespace
}  // namespace efdl::agent
