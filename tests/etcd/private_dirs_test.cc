// The sweep of private etcd directories (#38, etcd/private_dirs.h): a directory whose owner
// runs, or whose etcd database someone holds locked, or that is being set up, is never removed;
// one of a dead owner (a pid that is gone, or reused by another process) is. Real processes and
// real locks; no etcd needed.
#include "etcd/private_dirs.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "common/net.h"

namespace efdl::etcd {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

std::string MakeDir(const std::string& base, const std::string& suffix) {
  std::string path = base + "/efdl-etcd-" + suffix;
  fs::create_directories(path + "/member-data/member/snap");
  std::ofstream(path + "/member-data/member/snap/db") << "db";
  return path;
}

void WriteOwner(const std::string& dir, pid_t pid, uint64_t start) {
  std::ofstream(dir + "/" + kOwnerFile) << fmt::format("pid {} start {} test\n", pid, start);
}

// A pid that ran and is gone (forked, exited, reaped).
pid_t DeadPid() {
  pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return pid;
}

const PrivateEtcdDir* Find(const std::vector<PrivateEtcdDir>& dirs, const std::string& path) {
  auto it = std::find_if(dirs.begin(), dirs.end(),
                         [&](const PrivateEtcdDir& d) { return d.path == path; });
  return it == dirs.end() ? nullptr : &*it;
}

TEST(PrivateEtcdDirsTest, OnlyDeadOwnersDirectoriesAreSwept) {
  auto base = TempDir::Create("efdl-private-dirs-test");
  ASSERT_TRUE(base.ok()) << base.status().ToString();
  const std::string b = base->path();

  const std::string live = MakeDir(b, "live01");
  ASSERT_TRUE(WriteOwnerFile(live).ok());
  const std::string dead = MakeDir(b, "dead01");
  auto my_start = ProcessStartTicks(::getpid());
  ASSERT_TRUE(my_start.has_value());
  WriteOwner(dead, DeadPid(), *my_start);
  // This process's pid with another start time: the owner's pid was reused by someone else.
  const std::string reused = MakeDir(b, "reuse1");
  WriteOwner(reused, ::getpid(), *my_start + 12345);
  const std::string young = MakeDir(b, "young1");   // no owner file yet
  // A dead owner, but a process holds etcd's database lock (as a running etcd does).
  const std::string locked = MakeDir(b, "locked");
  WriteOwner(locked, DeadPid(), *my_start);
  int lock_pipe[2];
  ASSERT_EQ(::pipe(lock_pipe), 0);
  pid_t holder = ::fork();
  if (holder == 0) {
    ::close(lock_pipe[0]);
    int fd = ::open((locked + "/member-data/member/snap/db").c_str(), O_RDWR);
    if (fd < 0 || ::flock(fd, LOCK_EX) != 0) ::_exit(1);
    char ok = 'y';
    if (::write(lock_pipe[1], &ok, 1) != 1) ::_exit(2);
    ::pause();
    ::_exit(0);
  }
  ::close(lock_pipe[1]);
  char ok = 0;
  ASSERT_EQ(::read(lock_pipe[0], &ok, 1), 1);
  ::close(lock_pipe[0]);
  // Not ours to judge: a symbolic link named like a private directory, to a dead one.
  const std::string target = MakeDir(b + "/elsewhere", "target");
  WriteOwner(target, DeadPid(), *my_start);
  fs::create_directory_symlink(target, b + "/efdl-etcd-symlnk");

  auto scan = ScanPrivateEtcdDirs(b);
  ASSERT_EQ(scan.size(), 5u);
  for (const auto& [path, want] : {std::pair{live, true}, {dead, false}, {reused, false},
                                   {young, true}, {locked, true}}) {
    const PrivateEtcdDir* d = Find(scan, path);
    ASSERT_NE(d, nullptr) << path;
    EXPECT_EQ(d->live, want) << path << ": " << d->why;
    EXPECT_GT(d->bytes, 0u) << path;
  }

  auto would = RemoveStalePrivateEtcdDirs(b, /*dry_run=*/true);
  EXPECT_EQ(would.size(), 2u);
  EXPECT_TRUE(fs::exists(dead)) << "a dry run removed something";

  auto removed = RemoveStalePrivateEtcdDirs(b);
  EXPECT_EQ(removed.size(), 2u);
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_FALSE(fs::exists(reused));
  EXPECT_TRUE(fs::exists(live));
  EXPECT_TRUE(fs::exists(young));
  EXPECT_TRUE(fs::exists(locked)) << "the directory of a running etcd was removed";
  EXPECT_TRUE(fs::exists(target + "/member-data/member/snap/db")) << "a symbolic link was followed";

  ::kill(holder, SIGKILL);
  int status = 0;
  ::waitpid(holder, &status, 0);
  // The lock is gone with its holder: now the directory of the dead owner goes too.
  removed = RemoveStalePrivateEtcdDirs(b);
  EXPECT_EQ(removed.size(), 1u);
  EXPECT_FALSE(fs::exists(locked));
  // Without an owner file, a directory counts as being set up only while it is young.
  removed = RemoveStalePrivateEtcdDirs(b, false, /*young=*/0s);
  EXPECT_EQ(removed.size(), 1u);
  EXPECT_FALSE(fs::exists(young));
  EXPECT_TRUE(fs::exists(live));
}

}  // namespace
}  // namespace efdl::etcd
