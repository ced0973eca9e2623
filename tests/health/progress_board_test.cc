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
