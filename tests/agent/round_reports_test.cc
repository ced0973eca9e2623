// RoundReports alone (issue #31 step 1): the agent's books of what its workers reported on the
// control socket, fed made-up reports in the order a ControlServer would queue them.
#include "agent/round_reports.h"

#include <gtest/gtest.h>

namespace efdl::agent {
namespace {

using Kind = WorkerReport::Kind;

WorkerReport Of(Kind kind, int64_t round, int local_rank, int64_t step = -1) {
  WorkerReport r;
  r.kind = kind;
  r.round = round;
  r.rank = 10 + local_rank;
  r.local_rank = local_rank;
  r.step = step;
  return r;
}

TEST(RoundReportsTest, StoppingRanksAreByRoundAndOnlyThoseWithoutAGpuAreReleased) {
  RoundReports books;
  WorkerReport gpu_free = Of(Kind::kStopping, 4, 0, 7);
  gpu_free.released = true;
  books.Add(gpu_free);
  books.Add(Of(Kind::kStopping, 4, 1, 7));
  books.Add(Of(Kind::kStopping, 5, 2, 9));
  EXPECT_EQ(books.StoppingRanks(4), (std::vector<int>{0, 1}));
  EXPECT_EQ(books.ReleasedRanks(4), std::vector<int>{0});
  EXPECT_EQ(books.StoppingRanks(5), std::vector<int>{2});
  EXPECT_TRUE(books.ReleasedRanks(5).empty());
  EXPECT_TRUE(books.StoppingRanks(3).empty());
}

TEST(RoundReportsTest, AReturnCountsOncePerRankAndNotAfterTheRankWasAskedToStop) {
  RoundReports books;
  books.Add(Of(Kind::kReturned, 4, 1));
  books.Add(Of(Kind::kReturned, 4, 1));   // the program's loop and efdl's exit both say it
  books.Add(Of(Kind::kStopping, 4, 0, 3));
  books.Add(Of(Kind::kReturned, 4, 0));   // it exits 0 because it was asked to
  EXPECT_EQ(books.ReturnedRanks(4), std::vector<int>{1});
  books.Add(Of(Kind::kReturned, 5, 0));   // another round: asked nothing there
  EXPECT_EQ(books.ReturnedRanks(5), std::vector<int>{0});
}

TEST(RoundReportsTest, InProcessFailuresAreTakenOnceOldestFirstAndARaiseIsTheRanksOwn) {
  RoundReports books;
  WorkerReport lost = Of(Kind::kFailed, 4, 0);
  lost.message = "Connection reset by peer";
  books.Add(lost);
  WorkerReport raised = Of(Kind::kRaised, 4, 1);
  raised.message = "ValueError: bug";
  books.Add(raised);
  books.Add(Of(Kind::kFailed, 4, 2));
  const auto failures = books.TakeInProcessFailures();
  ASSERT_EQ(failures.size(), 3u);
  EXPECT_EQ(failures[0].rank, 10);
  EXPECT_FALSE(failures[0].own);
  EXPECT_EQ(failures[1].message, "ValueError: bug");
  EXPECT_TRUE(failures[1].own);
  EXPECT_EQ(failures[2].message, "no detail given");
  EXPECT_TRUE(books.TakeInProcessFailures().empty()) << "taken once";
}

TEST(RoundReportsTest, PausedRanksAndTheNewestPersistedStep) {
  RoundReports books;
  EXPECT_EQ(books.newest_persisted_step(), std::nullopt);
  books.Add(Of(Kind::kPaused, 4, 1, 18));
  books.Add(Of(Kind::kPersisted, 4, 0, 20));
  books.Add(Of(Kind::kPersisted, 4, 1, 12));   // an older one, late
  books.Add(Of(Kind::kPersisted, 4, 1, -1));   // none named
  EXPECT_EQ(books.PausedRanks(4), std::vector<int>{1});
  EXPECT_EQ(books.newest_persisted_step(), std::optional<int64_t>(20));
}

TEST(RoundReportsTest, ForgettingEarlierRoundsKeepsTheLaterOnes) {
  RoundReports books;
  for (int64_t round : {2, 3, 4}) {
    books.Add(Of(Kind::kStopping, round, 0));
    books.Add(Of(Kind::kPaused, round, 0));
    books.Add(Of(Kind::kReturned, round, 1));
  }
  books.ForgetBefore(3);
  EXPECT_TRUE(books.StoppingRanks(2).empty());
  EXPECT_TRUE(books.PausedRanks(2).empty());
  EXPECT_TRUE(books.ReturnedRanks(2).empty());
  EXPECT_EQ(books.StoppingRanks(3), std::vector<int>{0});
  EXPECT_EQ(books.ReturnedRanks(4), std::vector<int>{1});
}

TEST(RoundReportsTest, AReturnedListIsBoundedPerRound) {
  RoundReports books;
  for (int lr = 0; lr < 1000; ++lr) books.Add(Of(Kind::kReturned, 4, lr));
  EXPECT_EQ(books.ReturnedRanks(4).size(), RoundReports::kMaxPerRound);
}

}  // namespace
}  // namespace efdl::agent
