// LearnedImports alone (issue #31 step 1): the import reports workers write (imports-*.json),
// read into one list in the order first reported, and what the current zygote was sent of it;
// fake times, report files in a temporary directory, no zygote.
#include "agent/learned_imports.h"

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "../support/temp_dir_test.h"

namespace efdl::agent {
namespace {

using namespace std::chrono_literals;
using Names = std::vector<std::string>;

class LearnedImportsTest : public TempDirTest {
 protected:
  LearnedImportsTest() : TempDirTest("efdl-learned-imports-test") {}
  void Report(const std::string& name, const std::string& text) {
    std::ofstream(dir_.path() + "/" + name) << text;
  }
  const LearnedImports::Clock::time_point t0_{};
};

TEST_F(LearnedImportsTest, ReportsAreReadOnceASecondInFirstReportedOrderAndRemoved) {
  LearnedImports learned(dir_.path());
  Report("imports-10-1.json", R"(["numpy", "pandas"])");
  Report("imports-10-1.json.tmp", R"(["half_written"])");   // still being written
  learned.Read(t0_ + 1s);
  EXPECT_EQ(learned.names(), (Names{"numpy", "pandas"}));
  EXPECT_FALSE(std::filesystem::exists(dir_.path() + "/imports-10-1.json"));
  EXPECT_TRUE(std::filesystem::exists(dir_.path() + "/imports-10-1.json.tmp"));
  Report("imports-11-1.json", R"(["pandas", "scipy"])");
  Report("imports-12-1.json", "not json");
  learned.Read(t0_ + 1500ms);
  EXPECT_EQ(learned.names().size(), 2u) << "not a second since the last scan";
  learned.Read(t0_ + 2s);
  EXPECT_EQ(learned.names(), (Names{"numpy", "pandas", "scipy"})) << "each name once";
  EXPECT_FALSE(std::filesystem::exists(dir_.path() + "/imports-12-1.json")) << "unreadable too";
}

TEST_F(LearnedImportsTest, AZygoteIsSentWhatItLacksAndANewOneEverything) {
  LearnedImports learned(dir_.path());
  Report("imports-10-1.json", R"(["numpy"])");
  learned.Read(t0_ + 1s);
  EXPECT_EQ(learned.Unsent(), Names{"numpy"});
  EXPECT_FALSE(learned.awaiting());
  learned.Sent(t0_ + 1s);
  EXPECT_TRUE(learned.awaiting());
  EXPECT_TRUE(learned.Unsent().empty());
  EXPECT_DOUBLE_EQ(learned.Answered(t0_ + 3500ms), 2.5);
  EXPECT_FALSE(learned.awaiting());
  Report("imports-11-1.json", R"(["scipy"])");
  learned.Read(t0_ + 5s);
  EXPECT_EQ(learned.Unsent(), Names{"scipy"}) << "only what it was not sent";
  learned.NewZygote();
  EXPECT_EQ(learned.Unsent(), (Names{"numpy", "scipy"})) << "a new zygote gets everything";
}

TEST_F(LearnedImportsTest, TurnedOffItSendsAndReadsNothing) {
  LearnedImports learned(dir_.path());
  Report("imports-10-1.json", R"(["threader"])");
  learned.Read(t0_ + 1s);
  learned.TurnOff();
  EXPECT_TRUE(learned.off());
  EXPECT_TRUE(learned.Unsent().empty());
  Report("imports-11-1.json", R"(["scipy"])");
  learned.Read(t0_ + 5s);
  EXPECT_EQ(learned.names(), Names{"threader"});
  EXPECT_TRUE(std::filesystem::exists(dir_.path() + "/imports-11-1.json"));
}

TEST(LearnedImportsNoDirTest, WithoutADirectoryNothingIsLearned) {
  LearnedImports learned("");
  learned.Read(LearnedImports::Clock::time_point{} + 1s);
  EXPECT_TRUE(learned.names().empty());
  EXPECT_TRUE(learned.Unsent().empty());
}

}  // namespace
}  // namespace efdl::agent
