#include "health/progress_board.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/net.h"

namespace efdl::health {
namespace {

TEST(ProgressBoardTest, AWorkerProcessBeatsAndTheAgentReadsIt) {
  auto dir = TempDir::Create("efdl-board-test");
  ASSERT_TRUE(dir.ok());
  const std::string path = dir->path() + "/progress.board";
  auto board = ProgressBoard::Create(path, 2);
  ASSERT_TRUE(board.ok()) << board.status().ToString();
  EXPECT_EQ((*board)->Read(1).beats, 0u);
  const int64_t before = MonotonicNanos();
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto mine = ProgressBoard::Open(path);
    if (!mine.ok()) ::_exit(2);
    for (int i = 0; i < 5; ++i) (*mine)->Beat(1, 40 + i, ::getpid());
    (*mine)->ExpectPause(1, 30, ::getpid());
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  const SlotView v = (*board)->Read(1);
  EXPECT_EQ(v.beats, 5u);
  EXPECT_EQ(v.step, 44);
  EXPECT_EQ(v.pid, child);
  EXPECT_GE(v.last_ns, before);
  EXPECT_GE(v.pause_until_ns, v.last_ns + 29 * 1000000000LL);
  EXPECT_EQ((*board)->Read(0).beats, 0u);
  (*board)->Reset(1);
  EXPECT_EQ((*board)->Read(1).beats, 0u);
  EXPECT_EQ((*board)->Read(1).pause_until_ns, 0);
}

// Issue #32 part 3: a worker adds each measured step's compute time to its running totals; a
// reset (new workers) clears them.
TEST(ProgressBoardTest, ComputeTimeAddsUpPerSlotAndAResetClearsIt) {
  auto dir = TempDir::Create("efdl-board-test");
  ASSERT_TRUE(dir.ok());
  auto board = ProgressBoard::Create(dir->path() + "/progress.board", 2);
  ASSERT_TRUE(board.ok()) << board.status().ToString();
  (*board)->AddCompute(0, 20'000'000);
  (*board)->AddCompute(0, 30'000'000);
  (*board)->AddCompute(0, -5);   // not a time: ignored
  (*board)->AddCompute(1, 7);
  EXPECT_EQ((*board)->Read(0).compute_ns, 50'000'000);
  EXPECT_EQ((*board)->Read(0).compute_steps, 2);
  EXPECT_EQ((*board)->Read(1).compute_steps, 1);
  (*board)->Reset(0);
  EXPECT_EQ((*board)->Read(0).compute_ns, 0);
  EXPECT_EQ((*board)->Read(0).compute_steps, 0);
  EXPECT_EQ((*board)->Read(1).compute_ns, 7);
}

TEST(ProgressBoardTest, AFileThatIsNotABoardIsRefused) {
  auto dir = TempDir::Create("efdl-board-test");
  ASSERT_TRUE(dir.ok());
  const std::string path = dir->path() + "/not-a-board";
  FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs(std::string(200, 'x').c_str(), f);
  std::fclose(f);
  EXPECT_FALSE(ProgressBoard::Open(path).ok());
  EXPECT_FALSE(ProgressBoard::Open(dir->path() + "/missing").ok());
  EXPECT_FALSE(ProgressBoard::Create(dir->path() + "/b", 0).ok());
}

}  // namespace
}  // namespace efdl::health
