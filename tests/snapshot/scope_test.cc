// Whose snapshot goes where (snapshot/scope.h): scope names, the storage layout and the rule of
// who writes an arena and whose arena is stored, which State (through efdl._efdl) and the agent's
// persister both follow.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/net.h"
#include "snapshot/scope.h"

namespace efdl::snapshot {
namespace {

TEST(SnapshotScope, NamesAndTheirCheck) {
  EXPECT_EQ(ScopeName(false, 7), "node");
  EXPECT_EQ(ScopeName(true, 7), "rank7");
  for (const char* ok : {"node", "rank0", "rank12"}) EXPECT_TRUE(ValidScope(ok)) << ok;
  for (const char* bad : {"", "rank", "rank-1", "rank1a", "nodes", "Rank1"}) {
    EXPECT_FALSE(ValidScope(bad)) << bad;
  }
}

// One writer per arena; one stored copy per job (node copies) or per rank.
TEST(SnapshotScope, WhoWritesAndWhoseArenaIsStored) {
  struct Case {
    bool per_rank;
    int rank, local_rank;
    bool writes, stored;
  };
  for (const Case& c : {Case{false, 0, 0, true, true}, Case{false, 1, 1, false, false},
                        Case{false, 4, 0, true, false}, Case{false, 5, 1, false, false},
                        Case{true, 0, 0, true, true}, Case{true, 5, 1, true, true}}) {
    const SnapshotRole role = RoleOf(c.per_rank, c.rank, c.local_rank);
    EXPECT_EQ(role.scope, ScopeName(c.per_rank, c.rank));
    EXPECT_EQ(role.writes_arena, c.writes) << c.per_rank << " " << c.rank << " " << c.local_rank;
    EXPECT_EQ(role.stored, c.stored) << c.per_rank << " " << c.rank << " " << c.local_rank;
  }
}

TEST(SnapshotScope, StorageLayout) {
  EXPECT_EQ(JobStoreDir("/snap", "job-1"), "/snap/job-1");
  EXPECT_EQ(StoreDir("/snap", "job-1", false, 3), "/snap/job-1");
  EXPECT_EQ(StoreDir("/snap", "job-1", true, 3), "/snap/job-1/rank-3");
  EXPECT_EQ(StoreDir("rel", "j", true, 0), "rel/j/rank-0");
  EXPECT_TRUE(IsRankStoreName("rank-0"));
  EXPECT_TRUE(IsRankStoreName("rank-15"));
  for (const char* bad : {"rank-", "rank0", "rank-x", "snap-1.efdl", "rank-1.tmp"}) {
    EXPECT_FALSE(IsRankStoreName(bad)) << bad;
  }
}

TEST(SnapshotScope, RankStoreDirsListsThePerRankStoresOnly) {
  auto tmp = TempDir::Create("efdl-scope");
  ASSERT_TRUE(tmp.ok()) << tmp.status().message();
  const std::string job = JobStoreDir(tmp->path(), "job");
  for (int r : {0, 1, 10}) {
    std::filesystem::create_directories(StoreDir(tmp->path(), "job", true, r));
  }
  std::filesystem::create_directories(job + "/rank-x");
  std::ofstream(job + "/snap-1.efdl") << "x";
  std::vector<std::string> dirs = RankStoreDirs(job);
  std::sort(dirs.begin(), dirs.end());
  EXPECT_EQ(dirs, (std::vector<std::string>{job + "/rank-0", job + "/rank-1", job + "/rank-10"}));
  EXPECT_TRUE(RankStoreDirs(job + "/missing").empty());
}

}  // namespace
}  // namespace efdl::snapshot
