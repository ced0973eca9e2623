#include "common/subprocess.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>

#include <gtest/gtest.h>

namespace efdl {
namespace {

using namespace std::chrono_literals;

std::string ReadAll(int fd) {
  std::string out;
  char buf[256];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
  return out;
}

TEST(SubprocessTest, CapturesOutputAndExitStatus) {
  SpawnOptions o;
  o.argv = {"sh", "-c", "echo hello $EFDL_X; exit 3"};
  o.env_set["EFDL_X"] = "world";
  o.stdout_mode = SpawnOptions::Stdio::kPipe;
  auto p = Subprocess::Spawn(o);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(ReadAll(p->stdout_fd()), "hello world\n");
  int st = p->Wait();
  EXPECT_EQ(DescribeWaitStatus(st), "exited with status 3");
  EXPECT_FALSE(WaitStatusSuccess(st));
}

TEST(SubprocessTest, MissingProgramFailsBeforeStarting) {
  SpawnOptions o;
  o.argv = {"efdl-no-such-program-xyz"};
  auto p = Subprocess::Spawn(o);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("efdl-no-such-program-xyz"), std::string::npos);
}

TEST(SubprocessTest, StopEscalatesToSigkillForAChildIgnoringSigterm) {
  SpawnOptions o;
  o.argv = {"sh", "-c", "trap '' TERM; echo ignoring; while true; do sleep 0.05; done"};
  o.stdout_mode = SpawnOptions::Stdio::kPipe;
  auto p = Subprocess::Spawn(o);
  ASSERT_TRUE(p.ok());
  // The stop must find SIGTERM ignored: wait for the shell to say so, not for a fixed time
  // (a loaded machine may not have run the trap yet, and SIGTERM would end it at once).
  std::string said;
  char c;
  while (said.find('\n') == std::string::npos && ::read(p->stdout_fd(), &c, 1) == 1) said += c;
  ASSERT_EQ(said, "ignoring\n");
  auto start = std::chrono::steady_clock::now();
  int st = p->Stop(300ms);
  auto took = std::chrono::steady_clock::now() - start;
  EXPECT_TRUE(WIFSIGNALED(st));
  EXPECT_EQ(WTERMSIG(st), SIGKILL);
  EXPECT_GE(took, 250ms);
  EXPECT_LT(took, 5s);
}

TEST(SubprocessTest, DestructorKillsTheWholeGroup) {
  pid_t grandchild = -1;
  {
    SpawnOptions o;
    o.argv = {"sh", "-c", "sleep 30 & echo $!; wait"};
    o.stdout_mode = SpawnOptions::Stdio::kPipe;
    auto p = Subprocess::Spawn(o);
    ASSERT_TRUE(p.ok());
    char buf[32] = {};
    ASSERT_GT(::read(p->stdout_fd(), buf, sizeof(buf) - 1), 0);
    grandchild = std::stoi(buf);
    ASSERT_EQ(::kill(grandchild, 0), 0);
  }
  // The grandchild was in the group; it is killed (it may linger as a zombie of init briefly).
  auto deadline = std::chrono::steady_clock::now() + 3s;
  bool gone = false;
  while (std::chrono::steady_clock::now() < deadline) {
    std::string stat_path = "/proc/" + std::to_string(grandchild) + "/stat";
    FILE* f = std::fopen(stat_path.c_str(), "r");
    if (f == nullptr) { gone = true; break; }
    char state = 0;
    int ignored = std::fscanf(f, "%*d %*s %c", &state);
    (void)ignored;
    std::fclose(f);
    if (state == 'Z') { gone = true; break; }
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_TRUE(gone);
}

TEST(PipeLinesTest, ReturnsCompleteLinesKeepsTheRestAndCutsALineThatNeverEnds) {
  PipeLines lines(8);
  EXPECT_EQ(lines.Feed("one\ntw"), std::vector<std::string>{"one"});
  EXPECT_EQ(lines.Feed("o\n\nthree"), (std::vector<std::string>{"two", ""}));
  EXPECT_EQ(lines.TakeRest(), "three");
  EXPECT_EQ(lines.TakeRest(), "");
  EXPECT_EQ(lines.Feed("0123456789abcdefXY"),
            (std::vector<std::string>{"01234567", "89abcdef"}));   // bounded: 8 bytes
  EXPECT_EQ(lines.TakeRest(), "XY");
}

}  // namespace
}  // namespace efdl
