// `efdl snapshots ...` parsed and run in-process, against a real snapshot directory.
#include <gtest/gtest.h>

#include <fstream>

#include "cli/commands.h"
#include "common/net.h"
#include "snapshot/layout.h"
#include "snapshot/snapshot_file.h"
#include "snapshot/store.h"
#include "../support/temp_dir_test.h"

namespace efdl::cli {
namespace {

namespace snap = efdl::snapshot;

class SnapshotsCommandTest : public TempDirTest {
 protected:
  SnapshotsCommandTest() : TempDirTest("efdl-snapcli-test") {}
  void SetUpInDir() override {
    snap::SnapshotStore store(nullptr, dir_.path() + "/job1", 5);
    for (uint64_t seq = 1; seq <= 3; ++seq) {
      snap::Manifest m;
      m.job = "job1";
      m.seq = seq;
      m.step = static_cast<int64_t>(seq) * 100;
      m.tensors = {{"model/w", "float32", {4}, 0, 16}};
      m.data_bytes = snap::AssignOffsets(m.tensors);
      m.meta_json = R"({"kwargs":{"epoch":7}})";
      std::vector<uint8_t> data(m.data_bytes, static_cast<uint8_t>(seq));
      ASSERT_TRUE(store.Write(m, data.data(), snap::ChecksumOfRegion(m.tensors, data.data(),
                                                                     nullptr)).ok());
    }
  }
  // Runs `efdl snapshots <args>`; returns the exit code and fills out with stdout.
  int Run(std::vector<std::string> args, std::string* out) {
    CLI::App app;
    CommandRunner runner;
    RegisterSnapshotsCommand(app, runner);
    args.insert(args.begin(), "snapshots");
    std::vector<const char*> argv = {"efdl"};
    for (const auto& a : args) argv.push_back(a.c_str());
    app.parse(static_cast<int>(argv.size()), const_cast<char**>(argv.data()));
    ::testing::internal::CaptureStdout();
    int rc = runner.Run();
    *out = ::testing::internal::GetCapturedStdout();
    return rc;
  }
};

TEST_F(SnapshotsCommandTest, ListShowsEverySnapshotNewestFirst) {
  std::string out;
  ASSERT_EQ(Run({"list", "--job", "job1", "--snapshot-dir", dir_.path()}, &out), 0);
  auto p3 = out.find("snap-0000000000000003"), p1 = out.find("snap-0000000000000001");
  ASSERT_NE(p3, std::string::npos) << out;
  ASSERT_NE(p1, std::string::npos) << out;
  EXPECT_LT(p3, p1);
  ASSERT_EQ(Run({"show", "--job", "job1", "--snapshot-dir", dir_.path()}, &out), 0);
  EXPECT_NE(out.find("step 300"), std::string::npos) << out;
  EXPECT_NE(out.find("format 2"), std::string::npos) << out;
  EXPECT_NE(out.find(R"({"epoch":7})"), std::string::npos) << out;
  EXPECT_NE(out.find("model/w"), std::string::npos) << out;
}

TEST_F(SnapshotsCommandTest, VerifyFailsOnADamagedSnapshotAndNamesIt) {
  const std::string victim = dir_.path() + "/job1/snap-0000000000000002.efdl";
  {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(4096 + 3);
    f.put('\x55');
  }
  std::string out;
  EXPECT_EQ(Run({"verify", "--job", "job1", "--snapshot-dir", dir_.path()}, &out), 1);
  EXPECT_NE(out.find("DAMAGED"), std::string::npos) << out;
  EXPECT_NE(out.find("snap-0000000000000002.efdl failed its data checksum"), std::string::npos)
      << out;
  EXPECT_EQ(Run({"verify", "--job", "job1", "--snapshot-dir", dir_.path(), "--seq", "3"}, &out),
            0);
}

TEST_F(SnapshotsCommandTest, PruneKeepsTheNewestAndBadInputIsAnError) {
  std::string out;
  ASSERT_EQ(Run({"prune", "--job", "job1", "--snapshot-dir", dir_.path(), "--keep", "1"}, &out),
            0);
  EXPECT_NE(out.find("removed 2"), std::string::npos) << out;
  ASSERT_EQ(Run({"list", "--job", "job1", "--snapshot-dir", dir_.path(), "--json"}, &out), 0);
  EXPECT_EQ(out.find("snap-0000000000000002"), std::string::npos) << out;
  EXPECT_NE(out.find("snap-0000000000000003"), std::string::npos) << out;
  EXPECT_EQ(Run({"list", "--job", "nope", "--snapshot-dir", dir_.path()}, &out), 1);
  EXPECT_EQ(Run({"list", "--job", "../x", "--snapshot-dir", dir_.path()}, &out), 1);
}

}  // namespace
}  // namespace efdl::cli
