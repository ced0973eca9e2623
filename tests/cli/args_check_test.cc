// The command-line check that runs before CLI11: unknown words named with the closest real one,
// torchrun's spellings, a training command without `--`.
#include "cli/args_check.h"

#include <gtest/gtest.h>

namespace efdl::cli {
namespace {

using Args = std::vector<std::string>;

// A small `efdl` with the shape of the real one.
CommandSpec Efdl() {
  CommandSpec run{"efdl run", {}, {}, {}, true, false};
  run.options = {{{"--help", "-h"}, false},   {{"--etcd"}, true},      {{"--job"}, true},
                 {{"--nnodes"}, true},        {{"--nproc-per-node"}, true},
                 {{"--max-restarts"}, true},  {{"--launcher"}, false}, {{"--prestart"}, false},
                 {{"--no-prestart"}, false},  {{"--log-dir"}, true}};
  CommandSpec list{"efdl snapshots list", {{{"--help", "-h"}, false}, {{"--job"}, true}},
                   {}, {}, false, false};
  CommandSpec snapshots{"efdl snapshots", {{{"--help", "-h"}, false}}, {"list"}, {list}, false,
                        false};
  CommandSpec status{"efdl status", {{{"--help", "-h"}, false}, {{"--job"}, true}}, {}, {},
                     false, false};
  CommandSpec root{"efdl", {{{"--help", "-h"}, false}, {{"--version"}, false}},
                   {"run", "snapshots", "status"}, {run, snapshots, status}, false, false};
  return root;
}

std::string ErrorOf(const Args& args) {
  auto checked = CheckArgs(Efdl(), args);
  EXPECT_FALSE(checked.ok());
  return checked.ok() ? "" : checked.status().message();
}

TEST(EditDistance, CountsInsertionsDeletionsAndSubstitutions) {
  EXPECT_EQ(EditDistance("--nnode", "--nnodes"), 1u);
  EXPECT_EQ(EditDistance("stauts", "status"), 2u);
  EXPECT_EQ(EditDistance("", "abc"), 3u);
  EXPECT_EQ(EditDistance("same", "same"), 0u);
}

TEST(ClosestWord, SuggestsOnlyLikelyTypos) {
  EXPECT_EQ(ClosestWord("--nnode", {"--etcd", "--nnodes", "--job"}), "--nnodes");
  EXPECT_EQ(ClosestWord("stauts", {"run", "status", "snapshots"}), "status");
  EXPECT_EQ(ClosestWord("--nproc", {"--nproc-per-node", "--nnodes"}), "--nproc-per-node");
  EXPECT_EQ(ClosestWord("--frobnicate", {"--etcd", "--job"}), "");
}

TEST(CheckArgs, UnknownOptionIsNamedWithTheClosestFlagNotTheTrainingCommand) {
  const std::string e =
      ErrorOf({"run", "--nnode", "2", "--", "/usr/bin/python3", "x.py", "--epochs", "1"});
  EXPECT_NE(e.find("efdl run: error: unknown option '--nnode'"), std::string::npos) << e;
  EXPECT_NE(e.find("did you mean '--nnodes'?"), std::string::npos) << e;
  EXPECT_NE(e.find("`efdl run --help`"), std::string::npos) << e;
  EXPECT_EQ(e.find("x.py"), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << "one line";
}

TEST(CheckArgs, UnknownCommandIsNamedWithTheClosestCommand) {
  std::string e = ErrorOf({"stauts", "--job", "j"});
  EXPECT_NE(e.find("unknown command 'stauts'; did you mean 'status'?"), std::string::npos) << e;
  e = ErrorOf({"frobnicate"});
  EXPECT_NE(e.find("the commands are: run, snapshots, status"), std::string::npos) << e;
  e = ErrorOf({"snapshots", "lst"});
  EXPECT_NE(e.find("efdl snapshots: error: unknown command 'lst'; did you mean 'list'?"),
            std::string::npos)
      << e;
  e = ErrorOf({});
  EXPECT_NE(e.find("no command given; the commands are: run, snapshots, status"),
            std::string::npos)
      << e;
}

TEST(CheckArgs, TorchrunSpellingsWithTheSameMeaningAreRewritten) {
  auto checked = CheckArgs(Efdl(), {"run", "--nproc_per_node", "2", "--rdzv_id=j", "--rdzv-id",
                                    "k", "--max_restarts=5", "--", "python3", "--nproc_per_node"});
  ASSERT_TRUE(checked.ok()) << checked.status().ToString();
  EXPECT_EQ(*checked, (Args{"run", "--nproc-per-node", "2", "--job=j", "--job", "k",
                            "--max-restarts=5", "--", "python3", "--nproc_per_node"}));
}

TEST(CheckArgs, TorchrunFlagsWithoutAnEquivalentSayWhatToDo) {
  EXPECT_NE(ErrorOf({"run", "--rdzv_endpoint", "h:1", "--", "x"}).find("--etcd HOST:PORT"),
            std::string::npos);
  EXPECT_NE(ErrorOf({"run", "--node_rank=1", "--", "x"}).find("agree on their ranks"),
            std::string::npos);
  EXPECT_NE(ErrorOf({"run", "--master-addr", "h", "--", "x"}).find("--advertise-addr"),
            std::string::npos);
  EXPECT_NE(ErrorOf({"run", "--standalone", "--", "x"}).find("private etcd"), std::string::npos);
}

TEST(CheckArgs, TrainingCommandWithOptionsButNoDoubleDashIsCaught) {
  const std::string e = ErrorOf({"run", "--nnodes", "2", "python3", "x.py", "--epochs", "1"});
  EXPECT_NE(e.find("put `--` between efdl's options and the training command"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("'--epochs'"), std::string::npos) << e;
  // Without options of its own, a command without `--` is fine.
  EXPECT_TRUE(CheckArgs(Efdl(), {"run", "python3", "x.py"}).ok());
}

TEST(CheckArgs, ValuesAndHelpAreNotMistakenForWords) {
  // A value that looks like a command name, a flag's value starting with a dash.
  EXPECT_TRUE(CheckArgs(Efdl(), {"run", "--job", "status", "--", "x"}).ok());
  EXPECT_TRUE(CheckArgs(Efdl(), {"run", "--nnodes=2:3", "--launcher", "--", "x"}).ok());
  EXPECT_TRUE(CheckArgs(Efdl(), {"--help"}).ok());
  EXPECT_TRUE(CheckArgs(Efdl(), {"run", "--help", "--whatever"}).ok());
  EXPECT_TRUE(CheckArgs(Efdl(), {"snapshots", "list", "--job", "j"}).ok());
  EXPECT_FALSE(CheckArgs(Efdl(), {"status", "--jb", "j"}).ok());
}

}  // namespace
}  // namespace efdl::cli
