// The job id efdl's commands default to inside a Slurm allocation (#36).
#include "cli/slurm_job.h"

#include <gtest/gtest.h>

namespace efdl::cli {
namespace {

TEST(SlurmJobId, IsSlurmPrefixedJobId) {
  EXPECT_EQ(SlurmJobId("1234"), "slurm-1234");
  EXPECT_EQ(SlurmJobId("7"), "slurm-7");
}

TEST(SlurmJobId, ArrayTaskSuffixBecomesADash) {
  EXPECT_EQ(SlurmJobId("1234_5"), "slurm-1234-5");
}

TEST(SlurmJobId, EmptyOrMalformedGivesNothing) {
  for (const char* bad : {"", "abc", "12a", "_3", "12_", "1_2_3", "12 3", "../1", "-1"}) {
    EXPECT_EQ(SlurmJobId(bad), "") << bad;
  }
  EXPECT_EQ(SlurmJobId(std::string(65, '1')), "");
}

}  // namespace
}  // namespace efdl::cli
