// GroupReaper: the process groups it lists die when their owner dies without killing them, and
// only those. The owner is a forked copy of this test process that is SIGKILLed, as an agent
// killed by the OOM killer would be.
#include "common/group_reaper.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "common/net.h"
#include "common/subprocess.h"

namespace efdl {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// Alive and not a zombie.
bool Alive(pid_t pid) {
  FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
  if (f == nullptr) return false;
  char state = 0;
  int fields = std::fscanf(f, "%*d %*s %c", &state);
  std::fclose(f);
  return fields == 1 && state != 'Z';
}

bool GoneWithin(pid_t pid, std::chrono::milliseconds limit) {
  auto deadline = Clock::now() + limit;
  while (Alive(pid)) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(20ms);
  }
  return true;
}

struct Owner {
  pid_t pid = -1;            // the owner (SIGKILL it)
  pid_t worker = -1;         // its child, leading its own group (PR_SET_PDEATHSIG, like a worker)
  pid_t helper = -1;         // what the worker started: in the worker's group, no PDEATHSIG
  pid_t reaper = -1;         // the owner's reaper, or -1
};

// Forks an owner that (with a reaper, when asked) spawns a worker `sh` that starts a helper
// `sleep` and waits; the owner then waits to be killed.
Owner StartOwner(bool with_reaper) {
  int report[2];
  if (::pipe(report) != 0) return {};
  pid_t pid = ::fork();
  if (pid == 0) {
    ::close(report[0]);
    std::unique_ptr<GroupReaper> reaper;
    if (with_reaper) {
      auto started = GroupReaper::Start();
      if (!started.ok()) ::_exit(2);
      reaper = std::move(started).value();
    }
    SpawnOptions o;
    o.argv = {"sh", "-c", "sleep 600 & echo $!; wait"};
    o.stdout_mode = SpawnOptions::Stdio::kPipe;
    o.reaper = reaper.get();
    auto worker = Subprocess::Spawn(o);
    if (!worker.ok()) ::_exit(3);
    char buf[32] = {};
    if (::read(worker->stdout_fd(), buf, sizeof(buf) - 1) <= 0) ::_exit(4);
    long out[3] = {worker->pid(), std::stol(buf), reaper ? reaper->pid() : -1};
    if (::write(report[1], out, sizeof(out)) != static_cast<ssize_t>(sizeof(out))) ::_exit(5);
    while (true) ::pause();
  }
  ::close(report[1]);
  long in[3] = {-1, -1, -1};
  ssize_t n = ::read(report[0], in, sizeof(in));
  ::close(report[0]);
  Owner o;
  o.pid = pid;
  if (n == static_cast<ssize_t>(sizeof(in))) {
    o.worker = static_cast<pid_t>(in[0]);
    o.helper = static_cast<pid_t>(in[1]);
    o.reaper = static_cast<pid_t>(in[2]);
  }
  return o;
}

void KillOwner(pid_t owner) {
  ::kill(owner, SIGKILL);
  int status = 0;
  ::waitpid(owner, &status, 0);
}
void KillOwner(const Owner& o) { KillOwner(o.pid); }

// In a forked owner: a reaper, and `argv` spawned with it and without PR_SET_PDEATHSIG (only the
// reaper can end it). The owner exits 2 or 3 when either does not start.
std::pair<std::unique_ptr<GroupReaper>, Subprocess> ReaperAndChild(std::vector<std::string> argv) {
  auto reaper = GroupReaper::Start();
  if (!reaper.ok()) ::_exit(2);
  SpawnOptions o;
  o.argv = std::move(argv);
  o.die_with_parent = false;
  o.reaper = reaper->get();
  auto child = Subprocess::Spawn(o);
  if (!child.ok()) ::_exit(3);
  return {std::move(reaper).value(), std::move(child).value()};
}

TEST(GroupReaperTest, WhatAWorkerStartedDiesWhenItsOwnerIsKilled) {
  Owner o = StartOwner(/*with_reaper=*/true);
  ASSERT_GT(o.helper, 0);
  ASSERT_GT(o.reaper, 0);
  ASSERT_TRUE(Alive(o.helper));
  KillOwner(o);
  EXPECT_TRUE(GoneWithin(o.worker, 5s)) << "the worker outlived its owner";
  EXPECT_TRUE(GoneWithin(o.helper, 5s)) << "the worker's helper outlived the owner";
  EXPECT_TRUE(GoneWithin(o.reaper, 5s)) << "the reaper did not exit after its work";
  ::kill(-o.worker, SIGKILL);  // only if the check failed
}

// The control: without a reaper, PR_SET_PDEATHSIG takes the worker along but not its helper.
TEST(GroupReaperTest, WithoutAReaperTheHelperOutlivesItsOwner) {
  Owner o = StartOwner(/*with_reaper=*/false);
  ASSERT_GT(o.helper, 0);
  KillOwner(o);
  EXPECT_TRUE(GoneWithin(o.worker, 5s));
  std::this_thread::sleep_for(300ms);
  EXPECT_TRUE(Alive(o.helper)) << "the helper died without a reaper: this test shows nothing";
  ::kill(-o.worker, SIGKILL);
  EXPECT_TRUE(GoneWithin(o.helper, 5s));
}

TEST(GroupReaperTest, AnOrderlyEndKillsOnlyWhatIsStillListed) {
  auto reaper = GroupReaper::Start();
  ASSERT_TRUE(reaper.ok()) << reaper.status().ToString();
  pid_t reaper_pid = (*reaper)->pid();
  SpawnOptions o;
  o.argv = {"sleep", "600"};
  o.die_with_parent = false;
  auto kept = Subprocess::Spawn(o);     // listed, then unlisted: must survive the reaper's end
  auto listed = Subprocess::Spawn(o);   // listed until the reaper ends: killed by it
  ASSERT_TRUE(kept.ok() && listed.ok());
  ASSERT_TRUE((*reaper)->Add(kept->pid()).ok());
  ASSERT_TRUE((*reaper)->Add(listed->pid()).ok());
  ASSERT_TRUE((*reaper)->Remove(kept->pid()).ok());
  EXPECT_FALSE((*reaper)->Add(1).ok()) << "init is never a group to kill";
  reaper->reset();   // closes the socket and waits for the reaper
  EXPECT_FALSE(Alive(reaper_pid));
  EXPECT_TRUE(listed->WaitFor(5s).has_value()) << "a listed group survived the reaper's end";
  EXPECT_TRUE(kept->running()) << "an unlisted group was killed";
}

// A Subprocess given a reaper lists its group from the start, and the listing follows the
// object when it is moved (a spare handed over as a worker). The child here has no
// PR_SET_PDEATHSIG: only the reaper can end it.
TEST(GroupReaperTest, ASubprocessListsItsGroupFromTheStartAndWhenMoved) {
  int report[2];
  ASSERT_EQ(::pipe(report), 0);
  pid_t owner = ::fork();
  if (owner == 0) {
    ::close(report[0]);
    auto [reaper, spawned] = ReaperAndChild({"sleep", "600"});
    Subprocess moved = std::move(spawned);
    pid_t child = moved.pid();
    if (::write(report[1], &child, sizeof(child)) != sizeof(child)) ::_exit(4);
    while (true) ::pause();
  }
  ::close(report[1]);
  pid_t child = -1;
  ASSERT_EQ(::read(report[0], &child, sizeof(child)), static_cast<ssize_t>(sizeof(child)));
  ::close(report[0]);
  ASSERT_TRUE(Alive(child));
  KillOwner(owner);
  EXPECT_TRUE(GoneWithin(child, 5s)) << "the Subprocess's group was not listed";
  ::kill(-child, SIGKILL);  // only if the check failed
}

// The private etcd's directory (#38): a directory the owner listed is removed, with everything in
// it, once the owner is SIGKILLed - after the listed group (a writer into it, without
// PR_SET_PDEATHSIG) was killed. A symbolic link inside is removed, not followed; a directory the
// owner unlisted again stays.
TEST(GroupReaperTest, ListedDirectoriesGoWhenTheOwnerIsKilled) {
  namespace fs = std::filesystem;
  auto base = TempDir::Create("efdl-reaper-test");
  ASSERT_TRUE(base.ok()) << base.status().ToString();
  const std::string listed = base->path() + "/listed";
  const std::string unlisted = base->path() + "/unlisted";
  const std::string outside = base->path() + "/outside";
  fs::create_directories(listed + "/member-data/member/wal");
  fs::create_directories(unlisted);
  fs::create_directories(outside);
  std::ofstream(listed + "/member-data/member/wal/0.wal") << "wal";
  std::ofstream(listed + "/etcd.log") << "log";
  std::ofstream(outside + "/keep") << "keep";
  fs::create_directory_symlink(outside, listed + "/link");
  int report[2];
  ASSERT_EQ(::pipe(report), 0);
  pid_t owner = ::fork();
  if (owner == 0) {
    ::close(report[0]);
    // The writer writes into the listed directory until killed.
    auto [reaper, writer] = ReaperAndChild(
        {"sh", "-c", "while :; do date > \"$0/writer\"; sleep 0.01; done", listed});
    if (!reaper->AddDirectory(listed).ok() || !reaper->AddDirectory(unlisted).ok() ||
        !reaper->RemoveDirectory(unlisted).ok()) {
      ::_exit(4);
    }
    pid_t pids[2] = {writer.pid(), reaper->pid()};
    if (::write(report[1], pids, sizeof(pids)) != sizeof(pids)) ::_exit(5);
    while (true) ::pause();
  }
  ::close(report[1]);
  pid_t pids[2] = {-1, -1};
  ASSERT_EQ(::read(report[0], pids, sizeof(pids)), static_cast<ssize_t>(sizeof(pids)));
  ::close(report[0]);
  {
    auto other = GroupReaper::Start();
    ASSERT_TRUE(other.ok());
    EXPECT_FALSE((*other)->AddDirectory("relative/path").ok()) << "only absolute paths";
  }
  std::this_thread::sleep_for(100ms);
  ASSERT_TRUE(fs::exists(listed + "/writer"));
  KillOwner(owner);
  EXPECT_TRUE(GoneWithin(pids[0], 5s)) << "the writer outlived its owner";
  EXPECT_TRUE(GoneWithin(pids[1], 5s)) << "the reaper did not finish";
  EXPECT_FALSE(fs::exists(listed)) << "the listed directory outlived its killed owner";
  EXPECT_TRUE(fs::exists(unlisted)) << "a directory unlisted again was removed";
  EXPECT_TRUE(fs::exists(outside + "/keep")) << "the reaper followed a symbolic link";
  ::kill(-pids[0], SIGKILL);  // only if the check failed
}

}  // namespace
}  // namespace efdl
